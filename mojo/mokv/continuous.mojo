"""Continuous-batching cache: one contiguous `max_seq_len` slot per sequence.

Layout of the manager's buffer (python/mokv/layouts/continuous.py, `ContinuousBatchingKVCacheInputs`):

    blocks         [max_batch_size, 2, num_layers, max_seq_len, num_heads, head_size]
    cache_lengths  uint32 [batch_size]   tokens cached before this step
    lookup_table   uint32 [batch_size]   slot of each batch entry

    scales         float32 [max_batch_size, 2, num_layers, max_seq_len, num_heads,
                   head_size // SCALE_BLOCK]   a float8_e4m3fn cache's per-block scales,
                   slot by slot as the values (`mokv.kv_collection_ctor.continuous.scaled`);
                   none for other dtypes

Only the static dims (heads, head size) are struct parameters; slots, layers and
`max_seq_len` come from the buffer's runtime shape so one kernel serves every model size.
"""

from .types import DTYPE_CODE_FLOAT8_E4M3FN, KVCacheStaticParams, KVCacheT, KVCollectionT, Ptr, ScalePtr, U32Ptr, dtype_of, scales_per_head


struct ContinuousBatchingKVCache[dtype_: DType, num_heads: Int, head_size: Int](KVCacheT):
    """One layer's K or V of the batch's slots (a view; owns nothing)."""

    comptime dtype = Self.dtype_
    comptime kv_params = KVCacheStaticParams(num_heads=Self.num_heads, head_size=Self.head_size)

    var blocks: Ptr[Self.dtype]  # [max_batch_size, 2, num_layers, max_seq_len, num_heads, head_size]
    var cache_lengths: U32Ptr  # [batch_size]
    var lookup_table: U32Ptr  # [batch_size]
    var _batch_size: Int
    var max_seq_len: Int
    var slot_stride: Int  # elements between two slots: 2 * num_layers * max_seq_len * H * D
    var layer_offset: Int  # elements from a slot's start to this (kv, layer) plane
    var scales: ScalePtr  # [max_batch_size, 2, num_layers, max_seq_len, H, D // SCALE_BLOCK]
    var scales_slot_stride: Int  # the same strides in scales
    var scales_layer_offset: Int

    def __init__[blocks_dtype: DType, //](
        out self,
        blocks: Ptr[blocks_dtype],
        scales: ScalePtr,
        cache_lengths: U32Ptr,
        lookup_table: U32Ptr,
        batch_size: Int,
        num_layers: Int,
        max_seq_len: Int,
        kv_idx: Int,
        layer_idx: Int,
    ):
        # `dtype_of[code]()` does not fold at parse time, hence the inferred dtype + rebind.
        comptime assert blocks_dtype == Self.dtype, "blocks dtype does not match dtype_code"
        self.blocks = rebind[Ptr[Self.dtype]](blocks)
        self.cache_lengths = cache_lengths
        self.lookup_table = lookup_table
        self._batch_size = batch_size
        self.max_seq_len = max_seq_len
        comptime token_elems = Self.num_heads * Self.head_size
        self.slot_stride = 2 * num_layers * max_seq_len * token_elems
        self.layer_offset = (kv_idx * num_layers + layer_idx) * max_seq_len * token_elems
        self.scales = scales
        self.scales_slot_stride = 2 * num_layers * max_seq_len * Self.scale_stride()
        self.scales_layer_offset = (kv_idx * num_layers + layer_idx) * max_seq_len * Self.scale_stride()

    def batch_size(self) -> Int:
        return self._batch_size

    def cache_length(self, batch_idx: Int) -> Int:
        return Int(self.cache_lengths[unsafe_offset=batch_idx])

    def row_ptr(self, batch_idx: Int, head_idx: Int, tok: Int) -> Ptr[Self.dtype]:
        debug_assert(tok < self.max_seq_len, "token position past the slot's max_seq_len")
        var slot = Int(self.lookup_table[unsafe_offset=batch_idx])
        var off = slot * self.slot_stride + self.layer_offset + (tok * Self.num_heads + head_idx) * Self.head_size
        return self.blocks.unsafe_offset(off)

    def scale_ptr(self, batch_idx: Int, head_idx: Int, tok: Int) -> ScalePtr:
        debug_assert(tok < self.max_seq_len, "token position past the slot's max_seq_len")
        var slot = Int(self.lookup_table[unsafe_offset=batch_idx])
        var off = slot * self.scales_slot_stride + self.scales_layer_offset + tok * Self.scale_stride() + head_idx * scales_per_head[Self.head_size]()
        return self.scales.unsafe_offset(off)

    def max_positions(self) -> Int:
        return self.max_seq_len

    def contiguous_tokens(self, tok: Int) -> Int:
        return self.max_seq_len - tok

    @staticmethod
    def token_stride() -> Int:
        return Self.num_heads * Self.head_size



struct ContinuousBatchingKVCacheCollection[dtype_code: Int, num_heads: Int, head_size: Int](KVCollectionT):
    """K and V of every layer of a continuous-batching cache (a view; owns nothing).

    This is the opaque graph value built by `mokv.kv_collection_ctor.continuous`; its
    name and parameter names are what python/mokv/layouts/continuous.py puts in `_OpaqueType`.
    """

    comptime CacheType = ContinuousBatchingKVCache[Self.dtype, Self.num_heads, Self.head_size]
    comptime name_str = "continuous"
    comptime dtype = dtype_of[Self.dtype_code]()
    comptime scaled = Self.dtype_code == DTYPE_CODE_FLOAT8_E4M3FN

    var blocks: Ptr[Self.dtype]
    var scales: ScalePtr  # a float8_e4m3fn cache's scales (`mokv.kv_collection_ctor.continuous.scaled`); else unused
    var cache_lengths: U32Ptr
    var lookup_table: U32Ptr
    var _batch_size: Int
    var num_slots: Int  # the blocks' slots (max_batch_size): MAX's view of the cache needs it
    var _num_layers: Int
    var max_seq_len: Int
    var is_cache_empty: Bool  # kept for MAX's signature; no mokv kernel reads it

    @always_inline
    def __init__[blocks_dtype: DType, //](
        out self,
        blocks: Ptr[blocks_dtype],
        scales: ScalePtr,
        cache_lengths: U32Ptr,
        lookup_table: U32Ptr,
        batch_size: Int,
        num_slots: Int,
        num_layers: Int,
        max_seq_len: Int,
        is_cache_empty: Bool,
    ):
        # `dtype_of[code]()` does not fold at parse time, hence the inferred dtype + rebind.
        comptime assert blocks_dtype == Self.dtype, "blocks dtype does not match dtype_code"
        self.blocks = rebind[Ptr[Self.dtype]](blocks)
        self.scales = scales
        self.cache_lengths = cache_lengths
        self.lookup_table = lookup_table
        self._batch_size = batch_size
        self.num_slots = num_slots
        self._num_layers = num_layers
        self.max_seq_len = max_seq_len
        self.is_cache_empty = is_cache_empty

    def _cache(self, kv_idx: Int, layer_idx: Int) -> Self.CacheType:
        debug_assert(layer_idx < self._num_layers, "layer_idx out of range")
        return Self.CacheType(
            self.blocks,
            self.scales,
            self.cache_lengths,
            self.lookup_table,
            self._batch_size,
            self._num_layers,
            self.max_seq_len,
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
