"""Paged cache: fixed-size pages from one shared pool, found through a lookup table.

Layout of the manager's buffers (python/mokv/layouts/paged.py, `RaggedKVCacheInputs`):

    blocks        [total_num_pages, 2, num_layers, page_size, num_heads, head_size]
    cache_lengths uint32 [batch_size]                  tokens cached before this step
    lookup_table  uint32 [batch_size, max_num_pages]   page ids, in sequence order
    max_lengths   uint32 [num_steps, 2] (host)         row 0: (most new tokens of a sequence,
                                                       most cache + new tokens), MAX's meaning

    scales        float32 [total_num_pages, 2, num_layers, page_size, num_heads,
                  head_size // SCALE_BLOCK]   a float8_e4m3fn cache's per-block scales
                  (MAX's `KVCacheQuantizationConfig` layout); none for other dtypes

Token `tok` of entry `b` lives in page `lookup_table[b, tok // page_size]`, row
`tok % page_size`, and so do its scales. `page_size` is a parameter so that divisions become shifts when it
is a power of two; pages, layers and table width are runtime.
"""

from .types import DTYPE_CODE_FLOAT8_E4M3FN, KVCacheStaticParams, KVCacheT, KVCollectionT, Ptr, ScalePtr, U32Ptr, dtype_of, scales_per_head


struct PagedKVCache[dtype_: DType, num_heads: Int, head_size: Int, page_size: Int](KVCacheT):
    """One layer's K or V of the batch's pages (a view; owns nothing)."""

    comptime dtype = Self.dtype_
    comptime kv_params = KVCacheStaticParams(num_heads=Self.num_heads, head_size=Self.head_size)

    var blocks: Ptr[Self.dtype]  # [total_num_pages, 2, num_layers, page_size, num_heads, head_size]
    var cache_lengths: U32Ptr  # [batch_size]
    var lookup_table: U32Ptr  # [batch_size, max_num_pages]
    var _batch_size: Int
    var max_num_pages: Int
    var num_pages: Int
    var page_stride: Int  # elements of one page: 2 * num_layers * page_size * H * D
    var layer_offset: Int  # elements from a page's start to this (kv, layer) plane
    var scales: ScalePtr  # [total_num_pages, 2, num_layers, page_size, num_heads, D // SCALE_BLOCK]
    var scales_page_stride: Int  # the same strides in scales
    var scales_layer_offset: Int

    def __init__[blocks_dtype: DType, //](
        out self,
        blocks: Ptr[blocks_dtype],
        scales: ScalePtr,
        cache_lengths: U32Ptr,
        lookup_table: U32Ptr,
        batch_size: Int,
        max_num_pages: Int,
        num_pages: Int,
        num_layers: Int,
        kv_idx: Int,
        layer_idx: Int,
    ):
        comptime assert Self.page_size > 0, "page_size must be positive"
        # `dtype_of[code]()` does not fold at parse time, hence the inferred dtype + rebind.
        comptime assert blocks_dtype == Self.dtype, "blocks dtype does not match dtype_code"
        self.blocks = rebind[Ptr[Self.dtype]](blocks)
        self.cache_lengths = cache_lengths
        self.lookup_table = lookup_table
        self._batch_size = batch_size
        self.max_num_pages = max_num_pages
        self.num_pages = num_pages
        comptime page_plane = Self.page_size * Self.num_heads * Self.head_size
        self.page_stride = 2 * num_layers * page_plane
        self.layer_offset = (kv_idx * num_layers + layer_idx) * page_plane
        comptime scales_plane = Self.page_size * Self.scale_stride()
        self.scales = scales
        self.scales_page_stride = 2 * num_layers * scales_plane
        self.scales_layer_offset = (kv_idx * num_layers + layer_idx) * scales_plane

    def batch_size(self) -> Int:
        return self._batch_size

    def cache_length(self, batch_idx: Int) -> Int:
        return Int(self.cache_lengths[unsafe_offset=batch_idx])

    def _page_id(self, batch_idx: Int, tok: Int) -> Int:
        var page_idx = tok // Self.page_size
        debug_assert(page_idx < self.max_num_pages, "token position past the lookup table")
        var page_id = Int(self.lookup_table[unsafe_offset=batch_idx * self.max_num_pages + page_idx])
        debug_assert(page_id < self.num_pages, "page id past the blocks buffer")
        return page_id

    def row_ptr(self, batch_idx: Int, head_idx: Int, tok: Int) -> Ptr[Self.dtype]:
        var row = tok % Self.page_size
        var off = self._page_id(batch_idx, tok) * self.page_stride + self.layer_offset + (row * Self.num_heads + head_idx) * Self.head_size
        return self.blocks.unsafe_offset(off)

    def scale_ptr(self, batch_idx: Int, head_idx: Int, tok: Int) -> ScalePtr:
        comptime NB = scales_per_head[Self.head_size]()
        var row = tok % Self.page_size
        var off = self._page_id(batch_idx, tok) * self.scales_page_stride + self.scales_layer_offset + (row * Self.num_heads + head_idx) * NB
        return self.scales.unsafe_offset(off)

    def max_positions(self) -> Int:
        return self.max_num_pages * Self.page_size

    def contiguous_tokens(self, tok: Int) -> Int:
        return Self.page_size - tok % Self.page_size

    @staticmethod
    def token_stride() -> Int:
        return Self.num_heads * Self.head_size


struct PagedKVCacheCollection[dtype_code: Int, num_heads: Int, head_size: Int, page_size: Int](KVCollectionT):
    """K and V of every layer of a paged cache (a view; owns nothing).

    This is the opaque graph value built by `mokv.kv_collection_ctor.paged`.
    """

    comptime CacheType = PagedKVCache[Self.dtype, Self.num_heads, Self.head_size, Self.page_size]
    comptime name_str = "paged"
    comptime dtype = dtype_of[Self.dtype_code]()
    comptime scaled = Self.dtype_code == DTYPE_CODE_FLOAT8_E4M3FN

    var blocks: Ptr[Self.dtype]
    var scales: ScalePtr  # a float8_e4m3fn cache's scales (`mokv.kv_collection_ctor.paged.scaled`); else unused
    var cache_lengths: U32Ptr
    var lookup_table: U32Ptr
    var _batch_size: Int
    var max_num_pages: Int
    var num_pages: Int
    var _num_layers: Int
    # From `max_lengths` row 0, for MAX's kernels on a GPU (kernels/max_kernels.mojo); no
    # mokv kernel reads them.
    var max_new_tokens: Int  # most new tokens of one sequence this step (max_lengths[0, 0])
    var max_cache_length: Int  # most cache + new tokens of one sequence (max_lengths[0, 1])

    @always_inline
    def __init__[blocks_dtype: DType, //](
        out self,
        blocks: Ptr[blocks_dtype],
        scales: ScalePtr,
        cache_lengths: U32Ptr,
        lookup_table: U32Ptr,
        batch_size: Int,
        max_num_pages: Int,
        num_pages: Int,
        num_layers: Int,
        max_new_tokens: Int,
        max_cache_length: Int,
    ):
        # `dtype_of[code]()` does not fold at parse time, hence the inferred dtype + rebind.
        comptime assert blocks_dtype == Self.dtype, "blocks dtype does not match dtype_code"
        self.blocks = rebind[Ptr[Self.dtype]](blocks)
        self.scales = scales
        self.cache_lengths = cache_lengths
        self.lookup_table = lookup_table
        self._batch_size = batch_size
        self.max_num_pages = max_num_pages
        self.num_pages = num_pages
        self._num_layers = num_layers
        self.max_new_tokens = max_new_tokens
        self.max_cache_length = max_cache_length

    def _cache(self, kv_idx: Int, layer_idx: Int) -> Self.CacheType:
        debug_assert(layer_idx < self._num_layers, "layer_idx out of range")
        return Self.CacheType(
            self.blocks,
            self.scales,
            self.cache_lengths,
            self.lookup_table,
            self._batch_size,
            self.max_num_pages,
            self.num_pages,
            self._num_layers,
            kv_idx,
            layer_idx,
        )

    def get_key_cache(self, layer_idx: Int) -> Self.CacheType:
        return self._cache(0, layer_idx)

    def get_value_cache(self, layer_idx: Int) -> Self.CacheType:
        return self._cache(1, layer_idx)

    def num_layers(self) -> Int:
        return self._num_layers

    def batch_size(self) -> Int:
        return self._batch_size
