"""Decode and prefill scores S^T = K Q^T of one key tile, key-major ([keys, rows]),
in the forms that fit a unit's rows per KV head: 4-row register blocks (`qk_block`),
one row per head (`qk_heads`, GQA 1 decode) and tiles staged as f32 (`qk_key_major`,
prefill). GQA 8 and 4 decode have forms of their own (scores_group.mojo)."""

from std.sys.info import size_of
from std.sys.intrinsics import prefetch, PrefetchOptions

from ...types import KVCacheT, Ptr, SCALE_BLOCK, ScalePtr, is_quantized
from ..cpu import W
from ..fp8 import widened_scale
from ..simd import F32Ptr, dot_bf16, lane_sums, widen, widen_bf16
from .forms import BF16_DOT, KB, MAX_ROWS, RB


@always_inline
def qk_block[Cache: KVCacheT](
    qs: F32Ptr,  # [rows, D] scaled queries, f32 or (BF16_DOT) bf16, rows a multiple of RB
    s: F32Ptr,  # [BK, MAX_ROWS] scores of this tile, key-major
    r0: Int,
    kp: Ptr[Cache.dtype],  # the head's first key row of the tile
    ks: ScalePtr,  # an FP8 cache's scales of that row (else unused)
    j0: Int,
    n: Int,
):
    """S^T[j0 .. j0+KB, r0 .. r0+RB] = K Q^T for RB = 4 rows x KB = 4 keys at once: the
    form for heads of 12 rows (3 new tokens of GQA 4, 6 of GQA 2), which `qk_narrow`'s
    8 lanes do not divide.

    The 16 dot products are 16 independent FMA chains (one key at a time left 4
    chains, bound by FMA latency), and one butterfly reduces all 16 at once. Its lanes
    come out key by key (accumulator kk * RB + rr), so storing the scores key-major
    costs nothing, and every unit shares one lane-wise softmax (`softmax_key_major`):
    GQA 4 decode on one thread with the cache in L2 ran level with the row-major scores
    and per-row softmax this replaced (best of 400 runs at 128 keys: f32 32.7 vs 33.7
    us, bf16 20.0 vs 19.9), before `qk_narrow` took GQA 4 decode. Keys past n
    repeat key n-1 (never read past the page); their scores land in unused slots. With
    BF16_DOT a step is 32 elements of D as stored: `dot_bf16` multiplies adjacent pairs
    of D, which is how a key row lies in the cache, so K is used unconverted. An FP8
    cache's K is widened unscaled (to bf16 with BF16_DOT: `widen_bf16`, else to f32)
    and each key's sums scaled once (`widened_scale`).
    """
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    comptime DOT = BF16_DOT[Cache.dtype, D]
    comptime qdt = DType.bfloat16 if DOT else DType.float32
    comptime CH = 2 * W if DOT else W  # elements of D per step
    var koff = Array[Int, KB](fill=0)
    comptime for kk in range(KB):
        koff[kk] = min(j0 + kk, n - 1) * STRIDE
    var qp = qs.unsafe_bitcast[Scalar[qdt]]()
    var acc = Array[SIMD[DType.float32, W], W](fill=0)  # [kk * RB + rr]
    comptime for c in range(0, D, CH):
        var kv = Array[SIMD[qdt, CH], KB](fill=0)
        comptime for kk in range(KB):
            comptime if DOT and is_quantized[Cache.dtype]():
                kv[kk] = rebind[SIMD[qdt, CH]](widen_bf16(kp, koff[kk] + c))
            elif DOT:
                kv[kk] = rebind[SIMD[qdt, CH]](kp.unsafe_load[width=CH](koff[kk] + c))
            else:
                kv[kk] = rebind[SIMD[qdt, CH]](widen(kp, koff[kk] + c))
        comptime for rr in range(RB):
            var qv = qp.unsafe_load[width=CH]((r0 + rr) * D + c)
            comptime for kk in range(KB):
                comptime if DOT:
                    acc[kk * RB + rr] = dot_bf16(
                        acc[kk * RB + rr],
                        rebind[SIMD[DType.bfloat16, 2 * W]](qv),
                        rebind[SIMD[DType.bfloat16, 2 * W]](kv[kk]),
                    )
                else:
                    acc[kk * RB + rr] = rebind[SIMD[DType.float32, W]](qv).fma(
                        rebind[SIMD[DType.float32, W]](kv[kk]), acc[kk * RB + rr]
                    )
    comptime if is_quantized[Cache.dtype]():
        comptime assert D == SCALE_BLOCK, "one scale per key row"
        comptime for kk in range(KB):
            var ksc = widened_scale[Cache.scale_stride()](ks, min(j0 + kk, n - 1))
            comptime for rr in range(RB):
                acc[kk * RB + rr] *= ksc
    var sc = lane_sums(acc)
    comptime for kk in range(KB):
        s.unsafe_store((j0 + kk) * MAX_ROWS + r0, sc.slice[RB, offset=kk * RB]())


@always_inline
def qk_heads[Cache: KVCacheT](
    qs: F32Ptr,  # [rows, D] scaled queries, one row per head, f32 or (BF16_DOT) bf16
    s: F32Ptr,  # [BK, MAX_ROWS] scores of this tile, key-major
    h0: Int,  # first of the block's 16 heads (rows)
    nh: Int,  # the unit's heads
    kp: Ptr[Cache.dtype],  # the unit's first key row of the tile
    vp: Ptr[Cache.dtype],  # the unit's first value row of the tile (prefetched)
    ks: ScalePtr,  # an FP8 cache's scales of the unit's first key row of the tile (else unused)
    j: Int,
):
    """S^T[j, h0 .. h0 + 16] = one key's scores for 16 heads of one query row each
    (GQA 1 decode): 16 independent dot products over D, reduced by one butterfly whose
    lanes are the 16 heads, so the scores come out key-major. A key's rows for the
    unit's heads are adjacent in the cache, so the tile is read in address order, and
    each K line loaded prefetches the same line of V. Heads past nh repeat head nh - 1;
    their scores land in padding rows. Against 1 row x 16 keys per butterfly with the
    row-major softmax it replaced (32 KV heads): one thread with the cache in L3, f32
    40-45 -> 46-49 GB/s, bf16 44-45 -> 51-52; two threads at 1 x 16k, bf16 27-28 ->
    29-36 GB/s, f32 level within the noise (30-41 vs 29-38), four alternating runs.
    An FP8 cache's K is widened unscaled (as in `qk_block`) and each head's sum scaled
    once."""
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    comptime DOT = BF16_DOT[Cache.dtype, D]
    comptime qdt = DType.bfloat16 if DOT else DType.float32
    comptime CH = 2 * W if DOT else W  # elements of D per step
    comptime LINE_ELEMS = 64 // size_of[Scalar[Cache.dtype]]()
    var hoff = Array[Int, W](fill=0)
    comptime for hh in range(W):
        hoff[hh] = min(h0 + hh, nh - 1) * D
    var kj = kp.unsafe_offset(j * STRIDE)
    var vj = vp.unsafe_offset(j * STRIDE)
    var qp = qs.unsafe_bitcast[Scalar[qdt]]()
    var acc = Array[SIMD[DType.float32, W], W](fill=0)
    comptime for c in range(0, D, CH):
        comptime if c % LINE_ELEMS == 0:
            comptime for hh in range(W):
                prefetch[PrefetchOptions().for_read().medium_locality()](vj.unsafe_offset(hoff[hh] + c))
        comptime for hh in range(W):
            var qv = qp.unsafe_load[width=CH](hoff[hh] + c)
            comptime if DOT:
                var kv: SIMD[DType.bfloat16, 2 * W]
                comptime if is_quantized[Cache.dtype]():
                    kv = widen_bf16(kj, hoff[hh] + c)
                else:
                    kv = rebind[SIMD[DType.bfloat16, 2 * W]](kj.unsafe_load[width=CH](hoff[hh] + c))
                acc[hh] = dot_bf16(acc[hh], rebind[SIMD[DType.bfloat16, 2 * W]](qv), kv)
            else:
                acc[hh] = rebind[SIMD[DType.float32, W]](qv).fma(widen(kj, hoff[hh] + c), acc[hh])
    comptime if is_quantized[Cache.dtype]():
        comptime assert D == SCALE_BLOCK, "one scale per head: adjacent heads' scales are adjacent"
        comptime for hh in range(W):
            acc[hh] *= widened_scale[Cache.scale_stride()](ks.unsafe_offset(hoff[hh] // D), j)
    s.unsafe_store(j * MAX_ROWS + h0, lane_sums(acc))


@always_inline
def qk_key_major[D: Int, RV: Int](
    qt: F32Ptr,  # [D, MAX_ROWS] scaled queries, transposed
    kf: F32Ptr,  # [n, D] the head's key tile, staged as f32
    s: F32Ptr,  # [BK, MAX_ROWS] scores of this tile, key-major
    r0: Int,
    n: Int,
):
    """S^T[:n, r0 .. r0 + RV*W] = K Q^T, KBK keys x RV row vectors at a time.

    Key-major scores need no horizontal sums: each FMA multiplies a broadcast key
    element by W query rows' elements. RV row vectors x KBK keys = 16 accumulators;
    per element of D: RV query loads and KBK broadcasts feed 16 FMAs. Keys past n
    repeat key n-1; their scores land in unused slots.
    """
    comptime KBK = W // RV
    for j0 in range(0, n, KBK):
        var koff = Array[Int, KBK](fill=0)
        comptime for kk in range(KBK):
            koff[kk] = min(j0 + kk, n - 1) * D
        var acc = Array[SIMD[DType.float32, W], W](fill=0)  # [kk * RV + rv]
        for d in range(D):
            var qv = Array[SIMD[DType.float32, W], RV](fill=0)
            comptime for rv in range(RV):
                qv[rv] = qt.unsafe_load[width=W](d * MAX_ROWS + r0 + rv * W)
            comptime for kk in range(KBK):
                var kb = SIMD[DType.float32, W](kf.unsafe_load(koff[kk] + d))
                comptime for rv in range(RV):
                    acc[kk * RV + rv] = kb.fma(qv[rv], acc[kk * RV + rv])
        comptime for kk in range(KBK):
            comptime for rv in range(RV):
                s.unsafe_store((j0 + kk) * MAX_ROWS + r0 + rv * W, acc[kk * RV + rv])
