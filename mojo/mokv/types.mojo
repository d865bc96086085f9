"""Static cache facts and the two traits every cache kind implements.

Roles (after modular/modular max/kernels/src/kv_cache/types.mojo, trimmed to what
mokv's kernels use):
  `KVCacheT`       ONE layer's K or V cache for the sequences of a batch. Kernels read
                   and write token vectors through it and never see the layout.
  `KVCollectionT`  K and V of every layer; hands out `KVCacheT` views per layer.

Both are non-owning views: raw pointers into the manager's buffers plus ints. The
graph compiler copies an opaque collection bitwise into every consumer op and runs its
destructor once per copy, so a view must never own memory.

Opaque graph values cannot carry a `DType` parameter in MAX 26.7 (it is emitted as
`dtype=f32`, an unknown name), so the structs take an Int `dtype_code`; `dtype_of`
turns it back into a DType and `python/mokv/layouts/base.py` holds the same table.
"""

comptime Ptr[dtype: DType] = Pointer[Scalar[dtype], MutUntrackedOrigin]
"""Untracked mutable element pointer: views outlive no graph buffer but the compiler cannot know."""

comptime U32Ptr = Pointer[UInt32, MutUntrackedOrigin]
comptime ScalePtr = Pointer[Float32, MutUntrackedOrigin]
"""Float32 scales of a quantized cache (MAX 26.7's `KVCacheQuantizationConfig` scale dtype)."""

comptime DTYPE_CODE_FLOAT32 = 0
comptime DTYPE_CODE_BFLOAT16 = 1
comptime DTYPE_CODE_FLOAT16 = 2
comptime DTYPE_CODE_FLOAT8_E4M3FN = 3
"""float8_e4m3fn values with per-block scales (MAX's `KVCacheQuantizationConfig`)."""
comptime DTYPE_CODE_FLOAT8_E4M3FN_UNSCALED = 4
"""float8_e4m3fn values without scales: MAX's unscaled FP8 pages, on a GPU only
(kernels/unscaled_fp8.mojo)."""

comptime SCALE_BLOCK = 128
"""Lanes of a head that share one scale in a quantized cache: MAX 26.7's
`quantization_granularity` (python/mokv/config/quantization.py). The scales buffer is
[pages, 2, layers, page_size, heads, head_size // SCALE_BLOCK], beside the values."""


def is_quantized[dtype: DType]() -> Bool:
    """Whether a cache of `dtype` holds FP8 values (scaled or not: a collection's
    `scaled` says which)."""
    return dtype == DType.float8_e4m3fn


def scales_per_head[head_size: Int]() -> Int:
    """Scales of one token's head in a quantized cache."""
    return head_size // SCALE_BLOCK


def dtype_of[code: Int]() -> DType:
    """Returns the DType of a dtype code (the table in python/mokv/layouts/base.py)."""
    comptime assert code >= 0 and code <= 4, "unknown mokv dtype code"
    comptime if code == DTYPE_CODE_FLOAT32:
        return DType.float32
    elif code == DTYPE_CODE_BFLOAT16:
        return DType.bfloat16
    elif code == DTYPE_CODE_FLOAT16:
        return DType.float16
    else:
        return DType.float8_e4m3fn


def dtype_code_of[dtype: DType]() -> Int:
    """Returns the dtype code of a DType (the inverse of `dtype_of`)."""
    comptime assert (
        dtype == DType.float32 or dtype == DType.bfloat16 or dtype == DType.float16 or is_quantized[dtype]()
    ), "mokv caches hold float32, bfloat16, float16 or float8_e4m3fn"
    comptime if dtype == DType.float32:
        return DTYPE_CODE_FLOAT32
    elif dtype == DType.bfloat16:
        return DTYPE_CODE_BFLOAT16
    elif dtype == DType.float16:
        return DTYPE_CODE_FLOAT16
    else:
        return DTYPE_CODE_FLOAT8_E4M3FN


@fieldwise_init
struct KVCacheStaticParams(ImplicitlyCopyable, Movable):
    """Shape facts of one token's K (or V) in one layer, known at compile time."""

    var num_heads: Int
    """KV heads stored on this device."""
    var head_size: Int
    """Elements of one head's K or V vector."""


trait KVCacheT(TrivialRegisterPassable):
    """One layer's K or V cache for the sequences of the current batch.

    Token `tok` of batch entry `b` holds `num_heads` vectors of `head_size` elements,
    heads contiguous. Positions count from the start of the sequence (the cache
    prefix, then this step's new tokens). Callers keep `tok` below the capacity the
    manager reserved; debug builds assert it.
    """

    comptime dtype: DType
    comptime kv_params: KVCacheStaticParams

    def batch_size(self) -> Int:
        """Sequences in the batch."""
        ...

    def max_positions(self) -> Int:
        """Positions any sequence of this step can reach (the lookup table's or slot's
        capacity): known on the host, so GPU kernels size their grids by it."""
        ...

    def cache_length(self, batch_idx: Int) -> Int:
        """Tokens already cached for `batch_idx` before this step."""
        ...

    def row_ptr(self, batch_idx: Int, head_idx: Int, tok: Int) -> Ptr[Self.dtype]:
        """Address of the `head_size` elements of (batch entry, head, token position)."""
        ...

    def contiguous_tokens(self, tok: Int) -> Int:
        """How many tokens from `tok` on sit at a constant stride `token_stride()`.

        Paged caches stop at the page end; fast loops walk one such run at a time.
        """
        ...

    @staticmethod
    def token_stride() -> Int:
        """Elements between the same head of two consecutive tokens in one run."""
        ...

    def scale_ptr(self, batch_idx: Int, head_idx: Int, tok: Int) -> ScalePtr:
        """Address of the `scales_per_head` scales of (batch entry, head, token) in a
        quantized cache (their tokens `scale_stride()` apart in one run, as the values
        `token_stride()`); a cache of another dtype has no scales to address."""
        ...

    @staticmethod
    def scale_stride() -> Int:
        """Scales between the same head of two consecutive tokens in one run."""
        return Self.kv_params.num_heads * scales_per_head[Self.kv_params.head_size]()

    def load[width: Int](self, batch_idx: Int, head_idx: Int, tok: Int, dim: Int) -> SIMD[Self.dtype, width]:
        """Loads `width` elements of a K/V vector starting at element `dim`."""
        return self.row_ptr(batch_idx, head_idx, tok).unsafe_load[width=width](dim)

    def store[width: Int](self, batch_idx: Int, head_idx: Int, tok: Int, dim: Int, val: SIMD[Self.dtype, width]):
        """Stores `width` elements of a K/V vector starting at element `dim`."""
        self.row_ptr(batch_idx, head_idx, tok).unsafe_store(dim, val)


trait KVCollectionT(TrivialRegisterPassable):
    """K and V caches of every layer, for the sequences of the current batch.

    Trivial (no destructor, bitwise copies) because the graph compiler copies an opaque
    value into each consumer, and because MAX 26.7's graph-to-Mojo emitter may write
    `mogg_async_pack_value(coll^)` when a collection crosses a GPU region boundary while
    later ops of the same region still read it; a transfer from a trivial register
    type is a no-op, so those reads stay valid.
    """

    comptime CacheType: KVCacheT
    comptime name_str: StaticString
    comptime scaled: Bool
    """Whether the FP8 values have per-block scales (dtype code 3; code 4 is MAX's
    unscaled FP8 pages; False for a cache of another dtype)."""

    def get_key_cache(self, layer_idx: Int) -> Self.CacheType:
        """The K cache of `layer_idx`."""
        ...

    def get_value_cache(self, layer_idx: Int) -> Self.CacheType:
        """The V cache of `layer_idx`."""
        ...

    def num_layers(self) -> Int:
        """Layers in the cache buffer."""
        ...

    def batch_size(self) -> Int:
        """Sequences in the batch."""
        ...

