"""ContinuousBatchingKVCache views: slots via the lookup table, K/V and layer planes."""

from std.testing import assert_equal, TestSuite

from mokv.continuous import ContinuousBatchingKVCache, ContinuousBatchingKVCacheCollection

comptime H = 2
comptime D = 16
comptime LAYERS = 2
comptime SLOTS = 3
comptime MAX_SEQ = 5
comptime SLOT_ELEMS = 2 * LAYERS * MAX_SEQ * H * D


def _offset(slot: Int, kv: Int, layer: Int, tok: Int, head: Int) -> Int:
    """Flat index of [slot, kv, layer, tok, head, 0] in the blocks buffer."""
    return ((((slot * 2 + kv) * LAYERS + layer) * MAX_SEQ + tok) * H + head) * D


def test_views_write_through_to_the_slot() raises:
    var blocks = List[BFloat16](length=SLOTS * SLOT_ELEMS, fill=0)
    var lengths: List[UInt32] = [4, 0]
    var table: List[UInt32] = [2, 0]  # batch entry 0 -> slot 2, entry 1 -> slot 0
    var bp = blocks.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var coll = ContinuousBatchingKVCacheCollection[1, H, D](
        bp,
        lengths.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_bitcast[Float32](),  # no scales
        lengths.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        table.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        2,
        SLOTS,
        LAYERS,
        MAX_SEQ,
        False,
    )
    assert_equal(coll.num_layers(), LAYERS)
    assert_equal(coll.batch_size(), 2)
    comptime Cache = ContinuousBatchingKVCache[DType.bfloat16, H, D]
    var v = rebind[Cache](coll.get_value_cache(1))
    assert_equal(v.cache_length(0), 4)
    assert_equal(v.cache_length(1), 0)
    v.store[8](0, 1, 4, 8, SIMD[DType.bfloat16, 8](3))
    assert_equal(blocks[_offset(2, 1, 1, 4, 1) + 8], 3)
    assert_equal(blocks[_offset(2, 1, 1, 4, 1) + 7], 0)
    var k = rebind[Cache](coll.get_key_cache(0))
    k.store[16](1, 0, 0, 0, SIMD[DType.bfloat16, 16](5))
    assert_equal(blocks[_offset(0, 0, 0, 0, 0) + 15], 5)
    assert_equal(k.load[1](1, 0, 0, 15)[0], 5)
    assert_equal(k.contiguous_tokens(1), MAX_SEQ - 1)  # a slot is one contiguous run
    _ = blocks^
    _ = lengths^
    _ = table^


def test_scales_lie_beside_the_values_slot_by_slot() raises:
    """An FP8 cache's scales: [slot, kv, layer, tok, head, D // 128], found as its rows."""
    comptime DQ = 256  # two scales per head
    comptime NB = DQ // 128
    var blocks = List[Scalar[DType.float8_e4m3fn]](length=SLOTS * 2 * LAYERS * MAX_SEQ * H * DQ, fill=0)
    var scales = List[Float32](length=SLOTS * 2 * LAYERS * MAX_SEQ * H * NB, fill=0)
    var lengths: List[UInt32] = [4, 0]
    var table: List[UInt32] = [2, 0]
    var coll = ContinuousBatchingKVCacheCollection[3, H, DQ](
        blocks.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        scales.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        lengths.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        table.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        2,
        SLOTS,
        LAYERS,
        MAX_SEQ,
        False,
    )
    comptime Cache = ContinuousBatchingKVCache[DType.float8_e4m3fn, H, DQ]
    var v = rebind[Cache](coll.get_value_cache(1))
    v.scale_ptr(0, 1, 4).unsafe_store(1, Float32(7))  # entry 0 -> slot 2
    assert_equal(scales[((((2 * 2 + 1) * LAYERS + 1) * MAX_SEQ + 4) * H + 1) * NB + 1], 7)
    var k = rebind[Cache](coll.get_key_cache(0))
    k.scale_ptr(1, 0, 3).unsafe_store(0, Float32(5))  # entry 1 -> slot 0
    assert_equal(scales[(3 * H) * NB], 5)
    assert_equal(Cache.scale_stride(), H * NB)  # a token's scales, as its row's values
    _ = blocks^
    _ = scales^
    _ = lengths^
    _ = table^


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
