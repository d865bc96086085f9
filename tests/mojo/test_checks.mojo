"""Checked mode's table checks (mokv/kernels/checks.mojo): each bad entry raises, naming it.

The graph-level tests (tests/ops/test_checked_tables.py) run the same functions through
the registered op; here every case costs no graph compile.
"""

from std.testing import assert_raises, TestSuite

from mokv.kernels.checks import check_continuous_tables, check_offsets, check_paged_tables

comptime PAGE = 4
comptime PAGES = 6  # blocks dim 0
comptime LAYERS = 2


def _ptr(mut l: List[UInt32]) -> Pointer[UInt32, MutUntrackedOrigin]:
    return l.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()


def _paged(
    mut lengths: List[UInt32], mut table: List[UInt32], mut offsets: List[UInt32], total: Int, layer: Int = 1,
    max_positions: Int = 0,
) raises:
    """Batch of len(lengths) sequences, lookup rows of len(table) / len(lengths) pages."""
    var batch = len(lengths)
    check_paged_tables(
        _ptr(lengths), batch, _ptr(table), batch, len(table) // batch, PAGES, LAYERS, PAGE,
        _ptr(offsets), len(offsets), total, layer, max_positions,
    )


def test_valid_paged_tables_pass() raises:
    var lengths: List[UInt32] = [5, 0]
    var table: List[UInt32] = [3, 5, 0, 1, 2, 4]  # [2, 3]; unused entries past a sequence's pages are not read
    var offsets: List[UInt32] = [0, 1, 12]  # 5 + 1 = 6 positions: 2 pages; 0 + 11: 3 pages
    _paged(lengths, table, offsets, 12)
    # An entry past the pages a sequence touches may hold anything.
    table[2] = 1000
    _paged(lengths, table, offsets, 12)


def test_page_id_past_the_buffer() raises:
    var lengths: List[UInt32] = [5, 0]
    var table: List[UInt32] = [3, 6, 0, 1, 2, 4]
    var offsets: List[UInt32] = [0, 1, 12]
    with assert_raises(contains="lookup_table[0, 1] = 6 >= num_pages = 6"):
        _paged(lengths, table, offsets, 12)


def test_cache_length_beyond_the_lookup_row() raises:
    var lengths: List[UInt32] = [12, 0]
    var table: List[UInt32] = [3, 5, 1, 1, 2, 4]
    var offsets: List[UInt32] = [0, 1, 2]
    with assert_raises(contains="cache_lengths[0] = 12 + 1 new tokens = 13 positions > 12"):
        _paged(lengths, table, offsets, 2)
    # The RoPE table's rows cap positions too.
    lengths[0] = 2
    with assert_raises(contains="cache_lengths[0] = 2 + 1 new tokens = 3 positions > 2 rows of freqs_cis"):
        _paged(lengths, table, offsets, 2, max_positions=2)


def test_layer_past_num_layers() raises:
    var lengths: List[UInt32] = [0]
    var table: List[UInt32] = [1]
    var offsets: List[UInt32] = [0, 1]
    with assert_raises(contains="layer_idx = 2 >= num_layers = 2"):
        _paged(lengths, table, offsets, 1, layer=2)


def test_row_offsets() raises:
    var five: List[UInt32] = [0, 2, 5]
    check_offsets(_ptr(five), 3, 2, 5)
    with assert_raises(contains="input_row_offsets[2] = 5, expected total_tokens = 4"):
        check_offsets(_ptr(five), 3, 2, 4)  # rows past the queries
    with assert_raises(contains="input_row_offsets has 3 entries, expected batch_size + 1 = 4"):
        check_offsets(_ptr(five), 3, 3, 5)
    var down: List[UInt32] = [0, 3, 2]
    with assert_raises(contains="input_row_offsets decreases: [1] = 3 > [2] = 2"):
        check_offsets(_ptr(down), 3, 2, 2)
    var late: List[UInt32] = [1, 3]
    with assert_raises(contains="input_row_offsets[0] = 1, expected 0"):
        check_offsets(_ptr(late), 2, 1, 3)
    _ = five^  # the untracked pointers borrowed these lists' memory until here
    _ = down^
    _ = late^


def test_lookup_rows_must_match_the_batch() raises:
    var lengths: List[UInt32] = [0, 0]
    var table: List[UInt32] = [1, 2]
    var offsets: List[UInt32] = [0, 1, 2]
    with assert_raises(contains="lookup_table has 1 rows, expected batch_size = 2"):
        check_paged_tables(_ptr(lengths), 2, _ptr(table), 1, 2, PAGES, LAYERS, PAGE, _ptr(offsets), 3, 2, 0, 0)
    _ = lengths^  # the untracked pointers borrowed these lists' memory until here
    _ = table^
    _ = offsets^


def test_continuous_tables() raises:
    var lengths: List[UInt32] = [3, 7]
    var slots: List[UInt32] = [2, 0]
    var offsets: List[UInt32] = [0, 4, 5]
    # 3 slots of max_seq_len 8
    check_continuous_tables(_ptr(lengths), 2, _ptr(slots), 2, 3, LAYERS, 8, _ptr(offsets), 3, 5, 1, 0)
    slots[1] = 3
    with assert_raises(contains="lookup_table[1] = 3 >= max_batch_size = 3"):
        check_continuous_tables(_ptr(lengths), 2, _ptr(slots), 2, 3, LAYERS, 8, _ptr(offsets), 3, 5, 1, 0)
    slots[1] = 1
    lengths[1] = 8
    with assert_raises(contains="cache_lengths[1] = 8 + 1 new tokens = 9 positions > 8 (max_seq_len"):
        check_continuous_tables(_ptr(lengths), 2, _ptr(slots), 2, 3, LAYERS, 8, _ptr(offsets), 3, 5, 1, 0)
    with assert_raises(contains="lookup_table has 1 slots, expected batch_size = 2"):
        check_continuous_tables(_ptr(lengths), 2, _ptr(slots), 1, 3, LAYERS, 8, _ptr(offsets), 3, 5, 1, 0)
    _ = lengths^  # the untracked pointers borrowed these lists' memory until here
    _ = slots^
    _ = offsets^


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
