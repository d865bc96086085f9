"""O += P V for a block of a unit's rows, and O's column orders: decode's bf16 forms
keep O's columns in the order their widening or `vdpbf16ps` pairing leaves them, and
`o_natural` puts them back at the unit's output."""

from std.memory import bitcast
from std.utils.index import IndexList

from ...types import Ptr, SCALE_BLOCK, ScalePtr, is_quantized
from ..cpu import W
from ..fp8 import widened_scale
from ..simd import F32Ptr, dot_bf16, widen, widen_bf16, widen_even, widen_odd
from .forms import BF16_PV_DOT, MAX_ROWS, O_NATURAL, O_PAIRED, O_SPLIT, RB, SPLIT_PV
from .tiles import prefetch_spread


@always_inline
def pv_block[
    dtype: DType,
    D: Int,
    STRIDE: Int,
    rb: Int = RB,
    SSTRIDE: Int = 0,
    DOT: Bool = BF16_PV_DOT[dtype, D],
    SPLIT: Bool = SPLIT_PV[dtype, D],
](
    o: F32Ptr,  # [rows, D] output accumulators
    p: F32Ptr,  # probabilities of this tile, key-major: P[r, j] at j * MAX_ROWS + r
    r0: Int,
    vp: Ptr[dtype],  # first value row of the tile; rows STRIDE apart
    vs: ScalePtr,  # an FP8 cache's scales of that row, rows SSTRIDE apart (else unused)
    n: Int,
    pf: Ptr[dtype],  # rows to prefetch into L2, the columns of V being read (the next tile's K)
    pf_n: Int,  # rows of pf (0: no prefetch)
):
    """O[r0 .. r0+rb] += P[r0 .. r0+rb, :n] . V[:n], NC W-lane column chunks per pass:
    rb*NC = W accumulators, and each loaded V chunk / broadcast p serves NC / rb FMAs.
    rb = 8 (a GQA-8 head's rows) widens each bf16 V chunk once instead of twice.
    With SPLIT (`SPLIT_PV`), a bf16 V chunk pair is widened by one shift and one mask
    into its even and odd columns, and O's columns are kept in that order (`O_SPLIT`).
    With DOT (`BF16_PV_DOT`), p holds bf16 pairs (P[r, j], P[r, j+1]) in 32-bit slots
    ((j // 2) * MAX_ROWS + r, from `softmax_key_major`) and a step takes two keys: V
    rows j and j+1 interleaved are the adjacent pairs `dot_bf16` multiplies (row n-1
    repeats for an odd n, times 0). They are interleaved within 128-bit lanes (one
    `vpunpck{l,h}wd` per 32 columns and key pair, where a cross-lane interleave took
    two shuffles per 16 columns), so O's columns are kept in that paired order
    (`_pair_keys_mask`) until the unit's output (`o_natural`). One thread, cache in
    L2 (medians of three alternating runs): bf16 GQA 8 29.4 -> 27.5 us, GQA 4 35.3 ->
    33.6 us, GQA 1 78.7 -> 75.7 us; GQA 8 two threads at 1 x 16k 1.08 -> 1.05 ms.
    Each step prefetches the same columns of pf's rows. An FP8 cache's V is widened
    unscaled and each key's probability scaled instead (`widened_scale`: one scale
    per head), one multiply per row and key; with DOT, V is widened to bf16
    (`widen_bf16`) and p holds the probabilities already scaled (`softmax_key_major`
    rounds P times the scale to bf16 once)."""
    comptime KSTEP = 2 if DOT else 1
    comptime NC = _pv_chunks(W // rb, D)
    comptime assert not DOT or NC % 2 == 0, "BF16_DOT pairs V columns 32 at a time"
    comptime assert not SPLIT or NC % 2 == 0, "split widening makes column chunks in pairs"
    comptime for c0 in range(0, D, NC * W):
        var acc = Array[SIMD[DType.float32, W], rb * NC](fill=0)
        for j in range(0, n, KSTEP):
            if j < pf_n:
                prefetch_spread[dtype, KSTEP, NC * W, STRIDE, 1](pf.unsafe_offset(j * STRIDE + c0), 0)
            comptime if DOT:
                var j1 = min(j + 1, n - 1)
                var vv = Array[SIMD[DType.bfloat16, 2 * W], NC](fill=0)
                comptime for cc in range(0, NC, 2):
                    var v0: SIMD[DType.bfloat16, 2 * W]
                    var v1: SIMD[DType.bfloat16, 2 * W]
                    comptime if is_quantized[dtype]():
                        v0 = widen_bf16(vp, j * STRIDE + c0 + cc * W)
                        v1 = widen_bf16(vp, j1 * STRIDE + c0 + cc * W)
                    else:
                        v0 = rebind[SIMD[DType.bfloat16, 2 * W]](vp.unsafe_load[width=2 * W](j * STRIDE + c0 + cc * W))
                        v1 = rebind[SIMD[DType.bfloat16, 2 * W]](vp.unsafe_load[width=2 * W](j1 * STRIDE + c0 + cc * W))
                    vv[cc] = v0.shuffle[_pair_keys_mask[0]()](v1)
                    vv[cc + 1] = v0.shuffle[_pair_keys_mask[1]()](v1)
                comptime for rr in range(rb):
                    var pair = p.unsafe_bitcast[UInt32]().unsafe_load((j // 2) * MAX_ROWS + r0 + rr)
                    var pj = bitcast[DType.bfloat16, 2 * W](SIMD[DType.uint32, W](pair))
                    comptime for cc in range(NC):
                        acc[rr * NC + cc] = dot_bf16(acc[rr * NC + cc], pj, vv[cc])
            else:
                var vv = Array[SIMD[DType.float32, W], NC](fill=0)
                comptime if SPLIT:
                    comptime for cc in range(0, NC, 2):
                        var words = bitcast[DType.uint32, W](vp.unsafe_load[width=2 * W](j * STRIDE + c0 + cc * W))
                        vv[cc] = widen_even(words)
                        vv[cc + 1] = widen_odd(words)
                else:
                    comptime for cc in range(NC):
                        vv[cc] = widen(vp, j * STRIDE + c0 + cc * W)
                var vsc: Float32 = 1
                comptime if is_quantized[dtype]():
                    comptime assert SSTRIDE > 0 and D == SCALE_BLOCK, "one scale per head, SSTRIDE apart"
                    vsc = widened_scale[SSTRIDE](vs, j)
                comptime for rr in range(rb):
                    var pr = p.unsafe_load(j * MAX_ROWS + r0 + rr)
                    comptime if is_quantized[dtype]():
                        pr *= vsc
                    var pj = SIMD[DType.float32, W](pr)
                    comptime for cc in range(NC):
                        acc[rr * NC + cc] = pj.fma(vv[cc], acc[rr * NC + cc])
        comptime for rr in range(rb):
            comptime for cc in range(NC):
                var off = (r0 + rr) * D + c0 + cc * W
                o.unsafe_store(off, o.unsafe_load[width=W](off) + acc[rr * NC + cc])


def _pair_keys_mask[hi: Int]() -> IndexList[2 * W]:
    """Lanes of concat(a, b), two keys' rows of 32 bf16 V columns, that pair them as
    `vpunpcklwd` (hi = 0) / `vpunpckhwd` (hi = 1) do: in each 128-bit lane, columns
    0-3 / 4-7 of that lane's 8, a and b alternating. The two results hold columns
    {0-3, 8-11, 16-19, 24-27} and {4-7, 12-15, 20-23, 28-31}: O's paired order."""
    comptime assert W == 16, "the paired order is vdpbf16ps's (AVX-512 BF16)"
    var m = IndexList[2 * W]()
    for t in range(2 * W):
        m[t] = (t // 8) * 8 + hi * 4 + (t % 8) // 2 + (t % 2) * 2 * W
    return m


def _natural_columns_mask[half: Int]() -> IndexList[W]:
    """Lanes of concat(lo, hi), 32 O columns in paired order (`_pair_keys_mask`),
    that hold natural columns half * 16 .. half * 16 + 16."""
    comptime assert W == 16, "the paired order is vdpbf16ps's (AVX-512 BF16)"
    var m = IndexList[W]()
    for t in range(W):
        m[t] = (W if t % 8 >= 4 else 0) + half * 8 + (t // 8) * 4 + t % 4
    return m


@always_inline
def _split_columns_mask[half: Int]() -> IndexList[W]:
    """Lanes of concat(even, odd), 2W O columns in split order, that hold natural
    columns half * W .. half * W + W."""
    var m = IndexList[W]()
    for t in range(W):
        m[t] = (t % 2) * W + half * (W // 2) + t // 2
    return m


@always_inline
def o_natural[D: Int, order: Int](o: F32Ptr, r: Int, c: Int) -> SIMD[DType.float32, W]:
    """O[r, c .. c + W] in natural column order, from O kept in `order` (`O_NATURAL`,
    `O_PAIRED` or `O_SPLIT`)."""
    comptime if order == O_NATURAL:
        return o.unsafe_load[width=W](r * D + c)
    var c0 = c - c % (2 * W)
    var lo = o.unsafe_load[width=W](r * D + c0)
    var hi = o.unsafe_load[width=W](r * D + c0 + W)
    comptime if order == O_SPLIT:
        if c == c0:
            return lo.shuffle[_split_columns_mask[0]()](hi)
        return lo.shuffle[_split_columns_mask[1]()](hi)
    else:
        if c == c0:
            return lo.shuffle[_natural_columns_mask[0]()](hi)
        return lo.shuffle[_natural_columns_mask[1]()](hi)


def _pv_chunks(most: Int, D: Int) -> Int:
    """Column chunks per P V pass: the largest power of two up to `most` dividing D // W
    (`most` = W // rb, so rb * NC <= W accumulators: half the registers)."""
    var nc = most
    while nc > 1 and D % (nc * W) != 0:
        nc //= 2
    return nc
