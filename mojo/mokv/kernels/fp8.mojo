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
from .simd import E4M3FN_WIDENED, F32Ptr, widen

comptime E4M3FN_MAX: Float32 = 448


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
def widened_scale[SSTRIDE: Int](scales: ScalePtr, j: Int) -> Float32:
    """The factor that makes `widen`'s values of row j of a run (rows `SSTRIDE` scales
    apart, from the first row's `scales`) into the dequantized values: the row's
    scale times 256. With one scale per head (head_size 128) the decode forms fold it
    into the row's scores (K) or probabilities (V) instead of into each value."""
    return scales.unsafe_load(j * SSTRIDE) * (1 / E4M3FN_WIDENED)


@always_inline
def stage_scaled_tile[Cache: KVCacheT](dst: F32Ptr, src: Ptr[Cache.dtype], scales: ScalePtr, n: Int):
    """Copies n rows of one head of an FP8 cache into contiguous f32 [n, D],
    dequantized: q * scale, rounded once (the 2^-8 of `widen` is folded into the
    scale, a power of two)."""
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    comptime SSTRIDE = Cache.scale_stride()
    comptime assert is_quantized[Cache.dtype](), "stage_scaled_tile reads FP8 caches"
    var q = rebind[Ptr[DType.float8_e4m3fn]](src)
    for j in range(n):
        comptime for blk in range(scales_per_head[D]()):
            var s = SIMD[DType.float32, W](scales.unsafe_load(j * SSTRIDE + blk) * (1 / E4M3FN_WIDENED))
            comptime for c in range(blk * SCALE_BLOCK, (blk + 1) * SCALE_BLOCK, W):
                dst.unsafe_store(j * D + c, widen(q, j * STRIDE + c) * s)
