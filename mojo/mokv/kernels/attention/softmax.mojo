"""The online softmax over a tile's key-major scores, W rows at a time."""

from ..cpu import W
from ..simd import F32Ptr, exp2
from .forms import I32Ptr, MAX_ROWS

comptime LAZY_MAX: Float32 = 8
"""How far (log2 units) a row's scores may rise above its softmax reference before
the reference is raised and O rescaled (`softmax_key_major`)."""
comptime LOG2E: Float32 = 1.4426950408889634
comptime NO_KEY: Float32 = -1e30
"""A row's softmax reference before its first visible key: finite, so that a masked
score (`Float32.MIN`) in a tile of none of its keys (a sliding window's first tiles
for its later tokens) gives P = 2^(MIN - NO_KEY) = 0, where against a reference of MIN
it would give 2^0 = 1; and 2^(NO_KEY - m) = 0 against any real reference m."""


@always_inline
def _rescale_row[D: Int](o: F32Ptr, r: Int, alpha: Float32):
    """O[r] *= alpha, the online-softmax correction when a row's running max grows."""
    if alpha != 1:
        comptime for c in range(0, D, W):
            o.unsafe_store(r * D + c, o.unsafe_load[width=W](r * D + c) * alpha)


def softmax_key_major[D: Int, PAIRS: Bool, SCALED: Bool = False](
    s: F32Ptr,  # [BK, MAX_ROWS] scores S^T[j, r] of this tile, in log2 units
    m: F32Ptr,  # [MAX_ROWS] running maxima (the reference P is taken against)
    l: F32Ptr,  # [MAX_ROWS] running sums
    o: F32Ptr,  # [MAX_ROWS, D] output accumulators
    last: I32Ptr,  # [MAX_ROWS] each row's last visible position
    first: I32Ptr,  # [MAX_ROWS] each row's first visible position (a sliding window's)
    rows: Int,
    n: Int,
    k_tok: Int,  # position of the tile's first key
    masked: Bool,
    pb: F32Ptr,  # PAIRS: [BK // 2, MAX_ROWS] bf16 pairs of P
    ps: F32Ptr,  # SCALED: [BK, MAX_ROWS] what each P[r, j] is multiplied by in pb (an FP8 cache's V scales)
):
    """One online-softmax step over a tile's key-major scores, W rows at a time:
    maxima, masks and sums are lane-wise, with no horizontal reductions. P replaces
    the scores in s or, with PAIRS (`pv_block`'s BF16_DOT input), goes to pb rounded
    to bf16 pairs (P[r, j], P[r, j+1]) in 32-bit slots (j // 2) * MAX_ROWS + r, with
    P[r, n] = 0 for an odd n (rows up to a multiple of W: padding rows hold junk, never
    used). With SCALED (P V over an FP8 cache with `dot_bf16`), pb holds P[r, j] times
    ps[j, r], the key's V scale, rounded once, and the sums stay P's. A masked tile
    (the diagonal, or a sliding window's first tiles) hides the keys past a row's
    `last` and before its `first`. Rounding in the exp pass saves a pass over P; the
    maximum runs in four chains, where one was bound by the latency of a NaN-aware
    `max` (bf16 GQA 8, one thread: 16.4 -> 16.9 GB/s with the cache in L2, 2.27 ->
    2.08 ms at 16k).

    Scores are in log2 units (the queries carry log2(e)), so P = 2^(S - m) with the
    polynomial `exp2`, degree 3 when P is rounded to bf16 next. The running max m is
    raised lazily, as FlashAttention-4 does: only when some row of the 16 finds a
    score more than LAZY_MAX above it, so P stays <= 2^LAZY_MAX (no overflow in f32 or
    bf16), and most tiles after the first few skip the O rescale and its per-row
    tests. m is then a reference, not the maximum; the sums, the merge of splits and
    the output use it consistently. Against natural units, the standard `exp` and
    a rescale whenever a maximum grew (one thread, cache in L2, best of nine runs of
    200 calls): bf16 GQA 8 54.7 -> 51.9 us, f32 GQA 8 50.9 -> 48.9 us, bf16 GQA 4
    66.8 -> 63.1 us. Outputs moved within rounding: f32 with scores climbing to ~45
    (`test_rising_scores`), max abs error 7.9e-6 -> 1.6e-5 on outputs up to 2.2."""
    var pbh = pb.unsafe_bitcast[BFloat16]()
    for r0 in range(0, rows, W):
        var m_old = m.unsafe_load[width=W](r0)
        if masked:
            var last_v = last.unsafe_load[width=W](r0)
            var first_v = first.unsafe_load[width=W](r0)
            for j in range(n):
                var v = s.unsafe_load[width=W](j * MAX_ROWS + r0)
                var pos = SIMD[DType.int32, W](k_tok + j)
                v = (pos.gt(last_v) | pos.lt(first_v)).select(SIMD[DType.float32, W](Float32.MIN), v)
                s.unsafe_store(j * MAX_ROWS + r0, v)
        var mx4 = Array[SIMD[DType.float32, W], 4](fill=m_old)
        var j = 0
        while j < n:
            comptime for c in range(4):
                var v = s.unsafe_load[width=W](min(j + c, n - 1) * MAX_ROWS + r0)
                mx4[c] = mx4[c].gt(v).select(mx4[c], v)
            j += 4
        var mx = max(max(mx4[0], mx4[1]), max(mx4[2], mx4[3]))
        var raise_m = mx.gt(m_old + LAZY_MAX).reduce_or()
        var ref_m = mx if raise_m else m_old
        var sum = SIMD[DType.float32, W](0)
        comptime if PAIRS:
            var sum_odd = SIMD[DType.float32, W](0)
            for j in range(0, n, 2):
                var e0 = exp2[3](s.unsafe_load[width=W](j * MAX_ROWS + r0) - ref_m)
                var e1 = SIMD[DType.float32, W](0)
                if j + 1 < n:
                    e1 = exp2[3](s.unsafe_load[width=W]((j + 1) * MAX_ROWS + r0) - ref_m)
                sum += e0
                sum_odd += e1
                comptime if SCALED:
                    e0 *= ps.unsafe_load[width=W](j * MAX_ROWS + r0)
                    if j + 1 < n:  # (ps holds no key n)
                        e1 *= ps.unsafe_load[width=W]((j + 1) * MAX_ROWS + r0)
                var pair = e0.cast[DType.bfloat16]().interleave(e1.cast[DType.bfloat16]())
                pbh.unsafe_store(((j // 2) * MAX_ROWS + r0) * 2, pair)
            sum += sum_odd
        else:
            for j in range(n):
                var e = exp2[5](s.unsafe_load[width=W](j * MAX_ROWS + r0) - ref_m)
                s.unsafe_store(j * MAX_ROWS + r0, e)
                sum += e
        if not raise_m:
            l.unsafe_store(r0, l.unsafe_load[width=W](r0) + sum)
            continue
        var alpha = exp2[5](m_old - mx)
        m.unsafe_store(r0, mx)
        l.unsafe_store(r0, l.unsafe_load[width=W](r0) * alpha + sum)
        comptime for rr in range(W):
            _rescale_row[D](o, r0 + rr, alpha[rr])
