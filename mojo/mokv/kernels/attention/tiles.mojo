"""Moving a tile's K/V rows: software prefetches into L2, and staging as f32."""

from std.math import ceildiv
from std.sys.info import size_of
from std.sys.intrinsics import prefetch, PrefetchOptions

from ...types import KVCacheT, Ptr
from ..cpu import W
from ..simd import F32Ptr, widen


@always_inline
def prefetch_rows[Cache: KVCacheT](p: Ptr[Cache.dtype], n: Int, width: Int):
    """Prefetches n K or V rows of `width` elements into L2. A token's rows are one
    small run (4 KiB for 8 f32 heads of 128), often a page of its own, so the hardware
    stream prefetchers, which stop at page ends, never run far ahead. Callers issue a
    few of these per block of work rather than a tile at a time: a burst of thousands
    finds the miss buffers full, and the memory system then idles while the tile is
    computed on (decode read ~70% of the two-thread read bandwidth with bursts, ~80%
    spread out; L2 rather than L1 because the lines are read a phase later). The loop
    over a row's lines stays a runtime loop: unrolled, the prefetches issue back to
    back, and GQA 8 bf16 decode at 16k context fell from 18-22 to 11-17 GB/s (two
    threads, runs alternating with the loop)."""
    comptime STRIDE = Cache.token_stride()
    comptime LINE_ELEMS = 64 // size_of[Scalar[Cache.dtype]]()
    for j in range(n):
        for c in range(0, width, LINE_ELEMS):
            prefetch[PrefetchOptions().for_read().medium_locality()](p.unsafe_offset(j * STRIDE + c))


@always_inline
def prefetch_spread[dtype: DType, rows: Int, cols: Int, STRIDE: Int, steps: Int](p: Ptr[dtype], step: Int):
    """Step `step` of `steps` of prefetching `rows` rows x `cols` elements (rows STRIDE
    apart) into L2: the lines are dealt evenly over the steps of a compute loop, so
    that no step issues a burst (`steps` = 1: all of them now). Decode's inner loops
    carry the prefetches of the rows read next: a GQA 8 or 4 head's V rows ride on its
    score loop, one or two lines per step, and every decode P V block prefetches the
    same columns of the next tile's K rows as it reads V. Against a few `_prefetch_rows`
    calls per block (two threads, 1 x 16k, medians of five alternating runs): GQA 8
    bf16 1.67 -> 1.24 ms, f32 3.69 -> 2.90 ms; GQA 1 and 4 2-7% faster; one thread with
    the cache in L2 (best of 400), GQA 8 f32 65 -> 51 us, bf16 34.1 -> 31.5 us. In the
    4-row butterfly blocks (`_qk_block`) it did not help (f32 GQA 4 at 16k 5.2 -> 5.4
    ms)."""
    comptime LINE_ELEMS = 64 // size_of[Scalar[dtype]]()
    comptime LPR = ceildiv(cols, LINE_ELEMS)  # lines per row
    comptime TOTAL = rows * LPR
    comptime PER = max(1, TOTAL // steps)  # lines per step
    comptime EVERY = max(1, steps // TOTAL)  # steps per line
    comptime if EVERY > 1:
        if step % EVERY != 0:
            return
    comptime for i in range(PER):
        var line = (step // EVERY) * PER + i
        prefetch[PrefetchOptions().for_read().medium_locality()](
            p.unsafe_offset((line // LPR) * STRIDE + (line % LPR) * LINE_ELEMS)
        )


@always_inline
def stage_tile[Cache: KVCacheT](dst: F32Ptr, src: Ptr[Cache.dtype], n: Int):
    """Copies n rows of one head (`token_stride` apart in the cache) into contiguous
    f32 [n, D]. Key-major units read a tile once per 16-row block: staged, it is
    widened once and sits in L1 (one head's rows a whole token apart all map to the
    same few L1 sets)."""
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    for j in range(n):
        comptime for c in range(0, D, W):
            dst.unsafe_store(j * D + c, widen(src, j * STRIDE + c))
