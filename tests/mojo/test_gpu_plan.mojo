"""The GPU attention kernel's host-side plan (mokv/kernels/attention/gpu.mojo): lanes per
key, heads per unit and the key splits, checked on the CPU (the kernel itself runs in
tests/ops/test_on_gpu.py where a GPU is present)."""

from std.testing import assert_equal, assert_true, TestSuite

from mokv.kernels.attention.gpu import MAX_SPLIT_KEYS, MIN_SPLIT_KEYS, heads_per_unit, lanes_per_key, split_plan


def test_lanes_per_key_leave_eight_elements_per_lane() raises:
    assert_equal(lanes_per_key[128](), 16)  # one 16-byte bf16 load per lane
    assert_equal(lanes_per_key[64](), 8)
    assert_equal(lanes_per_key[256](), 32)
    assert_equal(lanes_per_key[512](), 32)  # a warp at most: 16 elements each
    assert_equal(lanes_per_key[96](), 8)  # 12 elements: not a power of two, loaded one by one
    assert_equal(lanes_per_key[16](), 2)
    assert_equal(lanes_per_key[4](), 1)


def test_heads_per_unit_divide_the_group() raises:
    assert_equal(heads_per_unit(1), 1)
    assert_equal(heads_per_unit(4), 4)
    assert_equal(heads_per_unit(8), 8)
    assert_equal(heads_per_unit(16), 8)  # two units per group: 8 heads' states per lane at most
    assert_equal(heads_per_unit(12), 4)
    assert_equal(heads_per_unit(6), 2)
    assert_equal(heads_per_unit(3), 1)


def test_split_plan() raises:
    # Decode, GQA 4 (8 head blocks of 4) x 32 tokens, 4096 positions: 16 splits of 256.
    var splits, keys = split_plan(256, 4096, 4)
    assert_equal(splits, 16)
    assert_equal(keys, 256)
    # One long sequence: splits stop at MIN_SPLIT_KEYS.
    splits, keys = split_plan(1, 16384, 4)
    assert_equal(keys, MIN_SPLIT_KEYS)
    assert_equal(splits, 64)
    # Prefill rows are many: few splits.
    splits, keys = split_plan(4096, 4096, 4)
    assert_equal(splits, 2)
    assert_equal(keys, 2048)
    # A capacity bound (a 16k continuous slot): splits stop at MAX_SPLIT_KEYS, so a short
    # context in the slot still gets several.
    splits, keys = split_plan(1024, 16385, 4)
    assert_equal(keys, MAX_SPLIT_KEYS)
    assert_equal(splits, 9)
    # Keys per split are a multiple of the loop step, and the splits cover every position.
    for rows in [1, 3, 50, 700]:
        for positions in [1, 255, 1000, 9999]:
            for step in [1, 4, 8]:
                splits, keys = split_plan(rows, positions, step)
                assert_true(keys % step == 0 and splits >= 1)
                assert_true(splits * keys >= positions, "splits must cover every position")
                assert_true((splits - 1) * keys < positions, "no split may start past the positions")


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
