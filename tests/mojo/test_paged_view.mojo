"""PagedKVCache views: writes land in the page the lookup table names, across page ends."""

from std.testing import assert_equal, assert_true, TestSuite

from mokv.paged import PagedKVCache, PagedKVCacheCollection

comptime H = 2
comptime D = 8
comptime PAGE = 4
comptime LAYERS = 3
comptime PAGES = 5
comptime PAGE_ELEMS = 2 * LAYERS * PAGE * H * D


def _offset(page: Int, kv: Int, layer: Int, row: Int, head: Int) -> Int:
    """Flat index of [page, kv, layer, row, head, 0] in the blocks buffer."""
    return ((((page * 2 + kv) * LAYERS + layer) * PAGE + row) * H + head) * D


def test_writes_land_in_looked_up_pages() raises:
    var storage = List[Float32](length=PAGES * PAGE_ELEMS, fill=0)
    var lengths_list: List[UInt32] = [3, 6]
    # [batch=2, max_num_pages=3]; both sequences share page 4 as their first page.
    var table_list: List[UInt32] = [4, 1, 0, 4, 2, 3]
    var blocks = storage.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var lengths = lengths_list.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var table = table_list.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var coll = PagedKVCacheCollection[0, H, D, PAGE](blocks, lengths.unsafe_bitcast[Float32](), lengths, table, 2, 3, PAGES, LAYERS, 1, 6)
    assert_equal(coll.num_layers(), LAYERS)
    assert_equal(coll.max_cache_length, 6)
    # The collection's dtype comes from an Int code and does not fold at parse time: rebind.
    comptime Cache = PagedKVCache[DType.float32, H, D, PAGE]
    var v = rebind[Cache](coll.get_value_cache(2))
    assert_equal(v.cache_length(0), 3)
    assert_equal(v.cache_length(1), 6)
    # Token 5 of entry 1 is page table[1, 1] = 2, row 1.
    v.store[4](1, 1, 5, 4, SIMD[DType.float32, 4](7))
    assert_equal(blocks[unsafe_offset=_offset(2, 1, 2, 1, 1) + 4], 7)
    assert_equal(blocks[unsafe_offset=_offset(2, 1, 2, 1, 1) + 3], 0)
    # Token 3 then token 4 of entry 0 straddle the end of page 4 and the start of page 1.
    var k = rebind[Cache](coll.get_key_cache(0))
    k.store[8](0, 0, 3, 0, SIMD[DType.float32, 8](1))
    k.store[8](0, 0, 4, 0, SIMD[DType.float32, 8](2))
    assert_equal(blocks[unsafe_offset=_offset(4, 0, 0, 3, 0)], 1)
    assert_equal(blocks[unsafe_offset=_offset(1, 0, 0, 0, 0)], 2)
    assert_equal(k.load[8](0, 0, 4, 0)[7], 2)
    # Shared prefix page: entry 1 sees what entry 0 wrote at the same position.
    assert_equal(k.load[1](1, 0, 3, 0)[0], 1)
    assert_equal(k.contiguous_tokens(3), 1)
    assert_equal(k.contiguous_tokens(4), 4)
    assert_equal(k.token_stride(), H * D)
    _ = storage^  # the views borrowed these lists' memory until here
    _ = lengths_list^
    _ = table_list^


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
