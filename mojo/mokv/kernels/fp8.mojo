"""FP8 (e4m3fn) pages with per-block scales, on the CPU: the quantize of a head's row as
a kernel writes it, and the widening of a stored row as attention reads it.

MAX 26.7's scaled FP8 cache (`KVCacheQuantizationConfig`, types.mojo's SCALE_BLOCK): a
block of 128 lanes of one token's head, x, is stored as

    scale = absmax(x) / 448          (float32; 448 is e4m3fn's largest finite value)
    q     = e4m3fn(x / scale)        (float32 division, nearest-even, saturating)

and read back as q * scale; a block of zeros has scale 0 and reads back zeros. The
float64 reference in tests/fp8_reference.py spells out the same steps.
"""

from ..types import KVCacheT, Ptr, SCALE_BLOCK, ScalePtr, is_quantized, scales_per_head
from .cpu import W
from .simd import F32Ptr

comptime E4M3FN_MAX: Float32 = 448
comptime E4M3FN_TO_F16_EXP: Float32 = 256
"""`widen_e4m3fn` returns q / 256: its callers fold the 256 into the scale."""


@always_inline
def _lanes[D: Int]() -> Int:
    return W if D % W == 0 else (8 if D % 8 == 0 else 1)


@always_inline
def store_row[Cache: KVCacheT, src_dtype: DType](cache: Cache, b: Int, h: Int, pos: Int, src: Ptr[src_dtype]):
    """Writes one head's `head_size` values (`src`) at (batch entry b, head h, position
    pos): cast to the cache's dtype, or, in an FP8 cache, quantized block by block
    with each block's scale beside the values."""
    comptime D = Cache.kv_params.head_size
    comptime L = _lanes[D]()
    var dst = cache.row_ptr(b, h, pos)
    comptime if is_quantized[Cache.dtype]():
        comptime assert D % SCALE_BLOCK == 0, "an FP8 cache's head_size is a multiple of 128"
        var scales = cache.scale_ptr(b, h, pos)
        comptime for blk in range(scales_per_head[D]()):
            comptime first = blk * SCALE_BLOCK
            var amax = SIMD[DType.float32, L](0)
            comptime for c in range(first, first + SCALE_BLOCK, L):
                amax = max(amax, abs(src.unsafe_load[width=L](c).cast[DType.float32]()))
            var scale = amax.reduce_max() / E4M3FN_MAX
            scales.unsafe_store(blk, scale)
            # A block of zeros: scale 0, values 0 (not 0 / 0).
            var divisor = SIMD[DType.float32, L](scale if scale > 0 else 1)
            comptime for c in range(first, first + SCALE_BLOCK, L):
                var x = src.unsafe_load[width=L](c).cast[DType.float32]()
                dst.unsafe_store(c, (x / divisor).cast[Cache.dtype]())
    else:
        comptime for c in range(0, D, L):
            dst.unsafe_store(c, src.unsafe_load[width=L](c).cast[Cache.dtype]())


@always_inline
def widen_e4m3fn[width: Int = W](p: Ptr[DType.float8_e4m3fn], off: Int) -> SIMD[DType.float32, width]:
    """Loads `width` e4m3fn values as float32, each divided by 256 (exactly).

    The byte's sign, exponent and mantissa moved into a float16's fields (the byte's
    7 low bits shifted up by 7 under its sign) make a float16 of value q * 2^-8:
    e4m3fn's exponent bias is 7, float16's 15, and a subnormal (exponent 0) maps to a
    float16 subnormal with the same ratio. The float16 then widens in hardware
    (`vcvtph2ps`) instead of through the generic e4m3fn conversion. NaN (0x7F/0xFF)
    never occurs: the quantize saturates."""
    var bits = p.unsafe_bitcast[UInt8]().unsafe_load[width=width](off).cast[DType.uint16]()
    var half = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
    return SIMD[DType.float16, width](from_bits=half).cast[DType.float32]()


@always_inline
def stage_scaled_tile[Cache: KVCacheT](dst: F32Ptr, src: Ptr[Cache.dtype], scales: ScalePtr, n: Int):
    """Copies n rows of one head of an FP8 cache into contiguous f32 [n, D],
    dequantized: q * scale, rounded once (the 2^-8 of `widen_e4m3fn` is folded into
    the scale, a power of two)."""
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    comptime SSTRIDE = Cache.scale_stride()
    comptime assert is_quantized[Cache.dtype](), "stage_scaled_tile reads FP8 caches"
    var q = rebind[Ptr[DType.float8_e4m3fn]](src)
    for j in range(n):
        comptime for blk in range(scales_per_head[D]()):
            var s = SIMD[DType.float32, W](scales.unsafe_load(j * SSTRIDE + blk) * E4M3FN_TO_F16_EXP)
            comptime for c in range(blk * SCALE_BLOCK, (blk + 1) * SCALE_BLOCK, W):
                dst.unsafe_store(j * D + c, widen_e4m3fn(q, j * STRIDE + c) * s)
