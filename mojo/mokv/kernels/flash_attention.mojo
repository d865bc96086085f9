"""Causal, grouped-query flash attention over a ragged batch and a KV cache layer.

    q   [total_tokens, n_q, D]   new tokens' queries (row offsets per batch entry)
    out [total_tokens, n_q, D]

New token `i` of entry `b` sits at position `p = cache_lengths[b] + i` and sees cache
positions [0, p]. The K/V of the new tokens must already be in the cache (store_kv or
fused_qkv_matmul ran first). Softmax is the online (flash) form in float32, taken in
powers of 2 against a reference maximum raised lazily (`_softmax_key_major`).

CPU design (decode is memory-bound, prefill compute-bound):
  * A work unit is (batch entry, tile of new tokens, block of KV heads, range of keys).
    Its rows are every query head of the GQA group for those tokens and heads, at
    most MAX_ROWS = 64. One pass over the unit's keys serves all its rows, so each K/V
    byte is read ONCE per GQA group (MAX 26.7's CPU kernel re-reads it per query
    head), and in prefill a K/V tile loaded into L1 serves 64 rows.
  * Decode (fewer than W rows per head): a unit takes as many KV heads as fit, so it
    reads each key tile's heads in address order. When batch x head blocks leaves
    too few units for the cores (one long sequence), the keys are split across
    units (flash-decoding), and the last split of a unit to finish combines their
    softmax states (`_merge_parts`).
  * Keys are walked in tiles of at most 64 tokens that never cross a page end
    (`contiguous_tokens`), so a tile is rows at one constant stride: 16 KiB of one
    head's K staged as f32 (prefill), 8 KiB of it as stored (decode).
    Halving the decode tile from 16 KiB sped up decode at 16k context by 2-15 %
    (bf16 GQA 4 the most, f32 GQA 4 the least; 4 and 12 KiB tiles were slower),
    measured with the sizes alternating in one run. Each head's V rows of a tile and
    K rows of the next tile are prefetched in software while the tile before them is
    computed on, spread over the inner loops (`_prefetch_spread` gives the numbers).
  * Scores are kept key-major, S^T [keys, rows], in every form, so one softmax serves
    all units and runs lane-wise over 16 rows, with no horizontal sums. Decode reads
    K as stored, in the form that fits its rows per head: 8 and 4 (GQA 8 and 4) in
    vectors of 8 or 16 lanes (`NARROW_LANES`, by CPU) with groups of key elements
    broadcast from the cache (`_qk_narrow`), or, for bf16 where `vdpbf16ps` runs at
    half rate, two rows per vector over keys widened in registers (`_qk_row_pairs`);
    1 (GQA 1) one key x 16 heads per butterfly, reading a key's rows in address order
    (`_qk_heads`); 12 (a few new tokens) in 4-row x 4-key register blocks, 16 FMA
    chains over D reduced by one butterfly (`_qk_block`). Each gives its measurements.
    A GQA 1 head's single row is not padded to 4 rows (4x the products: f32 53-79% ->
    84-110% of the two-thread read when that padding went, 32 KV heads, three
    alternating pairs).
    Prefill: S^T = K Q^T from a tile staged as f32, a broadcast key element times 16
    query rows per FMA. P V: a 4-row x 64-column block, 16 accumulators, each V chunk
    widened once per block (bf16 by a bit shift); 1 and 8 rows per head have their own
    block shapes.
  * bf16 caches on CPUs with AVX-512 BF16 (BF16_DOT, chosen when the kernels are
    built): decode scores and P V (neither where `vdpbf16ps` runs at half the f32
    FMA's rate: `ROW_PAIR_SCORES`, `BF16_PV_DOT`) use `vdpbf16ps`, 32 bf16 products per instruction
    into 16 f32 lanes, twice the f32 FMA's elements and no widening. It multiplies
    adjacent pairs along the reduction: for Q K^T these are adjacent head_dim
    elements, so K is read as stored; for P V two keys' V rows are interleaved. So
    the scaled Q is rounded to bf16 once per query and P once per tile; the softmax
    state (max, sum, O) stays f32. Measured against a float64 reference (GQA 1/4/8,
    1-4k keys, outputs rounded to bf16): max abs error 4.4-6.1e-4 vs 4.0-4.7e-4 with
    f32 products when scores have std 1 (output magnitudes up to ~0.2), 1.0-1.8e-2
    vs 3.5-5.8e-3 when they have std 4 (outputs up to ~2.3; the Q rounding error
    grows with the scores' size). GQA 8 bf16 at 16k context: ~2.9 -> ~2.0 ms.
  * Causality: the key loop stops at the unit's last visible position, so tiles the
    mask hides entirely are never read; only the diagonal tile applies a mask.
  * Units run in parallel on the op's device context (`parallel_units`).
GPU: flash-decoding units of one warp (kernels/gpu_attention.mojo; on the tensor cores when
asked, kernels/gpu_attention_mma.mojo).
"""

from std.atomic import Atomic
from std.math import ceildiv
from std.memory import bitcast, stack_allocation
from std.sys.info import CompilationTarget, num_physical_cores, size_of
from std.sys.intrinsics import prefetch, PrefetchOptions
from std.utils.index import IndexList

from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu

from ..types import KVCacheT, KVCollectionT, Ptr, U32Ptr
from .gpu_attention import gpu_attention, heads_per_unit
from .gpu_attention_mma import gpu_attention_mma, tensor_core_cache_ok
from .parallel import parallel_units
from .simd import F32Ptr, HAS_AVX512_BF16, HAS_AVX512F, W, _fold, dot_bf16, exp2, reduce_16, widen, widen_even, widen_odd

comptime I32Ptr = Pointer[Int32, MutUntrackedOrigin]
comptime BK = 64  # most keys per tile (the row stride of the score tile)
comptime MAX_ROWS = 64  # query rows (tokens x group heads) per unit: K/V tiles are loaded once per unit
comptime RB = 4  # rows per register block (rows are padded to a multiple of RB)
comptime KB = W // RB  # keys per QK register block: RB * KB = 16 accumulators
comptime NARROW_KEYS[stride_bytes: Int] = 16 if stride_bytes <= 2048 else 8
"""Keys per `_qk_narrow` block (one accumulator each) for K rows `stride_bytes`
apart. The block reads its keys' rows side by side, a cache line of each at a time;
rows a multiple of 4 KiB apart share one L1 set, and 16 such lines overflow its 12 ways.
The block's loop over L1-resident f32 rows: 16 keys ran at 96 GFLOP/s with 2 KiB
strides and 27 with 4, 8 or 16 KiB; 8 keys at 85-96 for all four."""
comptime NARROW_LANES = W if HAS_AVX512F and not CompilationTarget._is_arch["znver4"]() else 8
"""Lanes of `_qk_narrow`'s vectors. Zen 4 splits every 512-bit op in two, so 8 lanes
cost it no peak (117 GFLOP/s per core for f32 FMAs in 8 or 16 lanes, register-only),
and 16 were slower there (bf16 GQA 8, one thread in L2: 55.8 -> 58.5 us). CPUs with
whole 512-bit units run 16 lanes at twice the rate of 8 (emeraldrapids: 175 vs 95
GFLOP/s; `vdpbf16ps` 86 vs 47): there, against 8 lanes (`ab_decode.py`, 1 x 16k unless
said, three rounds), bf16 GQA 8 3.25 -> 2.34 ms, 4 x 8k 6.43 -> 4.46 ms, bf16 GQA 4
3.53 -> 2.55 ms, f32 GQA 8 x0.87-0.91, f32 GQA 4 x0.97."""
comptime LAZY_MAX: Float32 = 8
"""How far (log2 units) a row's scores may rise above its softmax reference before
the reference is raised and O rescaled (`_softmax_key_major`)."""
comptime LOG2E: Float32 = 1.4426950408889634
comptime MIN_SPLIT_KEYS = 256  # fewest keys a split of one unit's keys gets (split cost: one merge)
comptime SPLIT_ALIGN = 64  # split boundaries fall on multiples of this (whole key tiles)
comptime SPLIT_UNITS_PER_CORE = 8
"""Keys are split until there are this many units per core. With units taken on demand
(`parallel_units`) a core idles at most for the last unit's tail, so smaller units help
until their merges cost more: 4 -> 8 made median decode times 2-12 % lower on six of
seven 1 x 16k / 4 x 8k shapes and level on the seventh (GQA 1 bf16), six alternating runs."""
comptime PART_SLOT[D: Int] = MAX_ROWS * (D + 2)
"""Floats of one partial softmax state: o [MAX_ROWS, D], then m and l [MAX_ROWS]."""
comptime BF16_DOT[dtype: DType, D: Int] = HAS_AVX512_BF16 and dtype == DType.bfloat16 and D % (2 * W) == 0
"""Whether decode scores over a `dtype` cache use `dot_bf16`: Q is then rounded to
bf16 once per query (see the module docstring)."""
comptime HALF_RATE_BF16_DOT = CompilationTarget._is_arch["sapphirerapids"]() or CompilationTarget._is_arch[
    "emeraldrapids"
]()
"""Intel's server cores run `vdpbf16ps` at half the rate of an f32 FMA (emeraldrapids,
register-only loops, 16 lanes: 86 vs 175 GFLOP/s per core); Zen 4 runs both at one
512-bit op per cycle."""
comptime BF16_PV_DOT[dtype: DType, D: Int] = BF16_DOT[dtype, D] and not HALF_RATE_BF16_DOT
"""Whether decode P V over a `dtype` cache uses `dot_bf16` as well (P then rounded to
bf16 once per tile). Where `vdpbf16ps` runs at half rate, P V widens each V chunk to
f32 once and feeds it to the FMAs of all the head's rows instead: emeraldrapids,
against `dot_bf16` P V (1 x 16k unless said, three rounds): bf16 GQA 8 2.32 -> 1.97 ms,
4 x 8k 4.35 -> 3.74 ms, GQA 4 x0.90, GQA 1 x0.93."""
comptime SPLIT_PV[dtype: DType, D: Int] = dtype == DType.bfloat16 and not BF16_PV_DOT[dtype, D] and D % (2 * W) == 0
"""Whether decode P V over a bf16 cache widens V in split order: 32 bf16 columns are
loaded as 16 32-bit words, and a shift and a mask make the even columns and the odd
ones into two f32 vectors (one op per 16 columns instead of two for a zero-extension
and a shift). O's columns are then kept even-then-odd per 32 (`O_SPLIT`) until the
unit's output. emeraldrapids, bf16 GQA 8 with `_qk_row_pairs`, direct calls
(`decode_direct.mojo`, alternating): two threads at 1 x 16k 1.44-1.46 -> 1.39 ms, one
thread in L2 (768 keys) 118-120 -> 112 us; GQA 1 in L2 38.6 -> 36.7 us."""
comptime ROW_PAIR_SCORES[dtype: DType, D: Int] = HALF_RATE_BF16_DOT and dtype == DType.bfloat16 and D % W == 0
"""Whether GQA 8 and 4 decode scores over a `dtype` cache are f32 FMAs over K widened
in registers (`_qk_row_pairs`) rather than `vdpbf16ps` (`_qk_narrow`): where that
instruction runs at half the FMA's rate."""


@always_inline
def _prefetch_rows[Cache: KVCacheT](p: Ptr[Cache.dtype], n: Int, width: Int):
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
def _prefetch_spread[dtype: DType, rows: Int, cols: Int, STRIDE: Int, steps: Int](p: Ptr[dtype], step: Int):
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
def _qk_block[Cache: KVCacheT](
    qs: F32Ptr,  # [rows, D] scaled queries, f32 or (BF16_DOT) bf16, rows a multiple of RB
    s: F32Ptr,  # [BK, MAX_ROWS] scores of this tile, key-major
    r0: Int,
    kp: Ptr[Cache.dtype],  # the head's first key row of the tile
    j0: Int,
    n: Int,
):
    """S^T[j0 .. j0+KB, r0 .. r0+RB] = K Q^T for RB = 4 rows x KB = 4 keys at once: the
    form for heads of 12 rows (3 new tokens of GQA 4, 6 of GQA 2), which `_qk_narrow`'s
    8 lanes do not divide.

    The 16 dot products are 16 independent FMA chains (one key at a time left 4
    chains, bound by FMA latency), and one butterfly reduces all 16 at once. Its lanes
    come out key by key (accumulator kk * RB + rr), so storing the scores key-major
    costs nothing, and every unit shares one lane-wise softmax (`_softmax_key_major`):
    GQA 4 decode on one thread with the cache in L2 ran level with the row-major scores
    and per-row softmax this replaced (best of 400 runs at 128 keys: f32 32.7 vs 33.7
    us, bf16 20.0 vs 19.9), before `_qk_narrow` took GQA 4 decode. Keys past n
    repeat key n-1 (never read past the page); their scores land in unused slots. With
    BF16_DOT a step is 32 elements of D as stored: `dot_bf16` multiplies adjacent pairs
    of D, which is how a key row lies in the cache, so K is used unconverted.
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
            comptime if DOT:
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
    var sc = reduce_16(acc)
    comptime for kk in range(KB):
        s.unsafe_store((j0 + kk) * MAX_ROWS + r0, sc.slice[RB, offset=kk * RB]())


@always_inline
def _qk_heads[Cache: KVCacheT](
    qs: F32Ptr,  # [rows, D] scaled queries, one row per head, f32 or (BF16_DOT) bf16
    s: F32Ptr,  # [BK, MAX_ROWS] scores of this tile, key-major
    h0: Int,  # first of the block's 16 heads (rows)
    nh: Int,  # the unit's heads
    kp: Ptr[Cache.dtype],  # the unit's first key row of the tile
    vp: Ptr[Cache.dtype],  # the unit's first value row of the tile (prefetched)
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
    29-36 GB/s, f32 level within the noise (30-41 vs 29-38), four alternating runs."""
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
                acc[hh] = dot_bf16(
                    acc[hh],
                    rebind[SIMD[DType.bfloat16, 2 * W]](qv),
                    rebind[SIMD[DType.bfloat16, 2 * W]](kj.unsafe_load[width=CH](hoff[hh] + c)),
                )
            else:
                acc[hh] = rebind[SIMD[DType.float32, W]](qv).fma(widen(kj, hoff[hh] + c), acc[hh])
    s.unsafe_store(j * MAX_ROWS + h0, reduce_16(acc))


@always_inline
def _qk_key_major[D: Int, RV: Int](
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


@always_inline
def _store_narrow_q[R: Int, DOT: Bool, V: Int = NARROW_LANES](
    head_q: F32Ptr, r: Int, c: Int, qv: SIMD[DType.float32, W]
):
    """Stores elements c .. c + W of scaled query row r of a head of R rows where
    `_qk_narrow` reads them: in steps of V lanes, lane (r, e) holding PAIR consecutive
    elements of D (2 with BF16_DOT, else 1), e < V / R, so that one step covers
    G = (V / R) x PAIR elements of D. Groups of G elements are moved whole, R groups
    apart (one element at a time with its index computed took ~13 % of bf16 GQA 8
    decode units of 256 keys)."""
    comptime PAIR = 2 if DOT else 1
    comptime G = (V // R) * PAIR
    comptime qdt = DType.bfloat16 if DOT else DType.float32
    var qc = qv.cast[qdt]()
    var dst = head_q.unsafe_bitcast[Scalar[qdt]]().unsafe_offset(((c // G) * R + r % R) * G)
    comptime for k in range(W // G):
        dst.unsafe_store(k * R * G, qc.slice[G, offset=k * G]())


@always_inline
def _qk_narrow[Cache: KVCacheT, R: Int, full: Bool, V: Int = NARROW_LANES](
    qt: F32Ptr,  # the head's scaled queries in lane order (`_store_narrow_q`), f32 or (BF16_DOT) bf16
    s: F32Ptr,  # [BK, MAX_ROWS] scores of this tile, key-major
    r0: Int,  # the head's first row
    kp: Ptr[Cache.dtype],  # the head's first key row of the tile
    vp: Ptr[Cache.dtype],  # the head's first value row of the tile (a full block prefetches its rows as it goes)
    j0: Int,
    n: Int,  # keys in the tile; `full`: j0 + NK <= n
):
    """S^T[j0 .. j0 + NK, r0 .. r0 + R] = K Q^T for a head of R = 8 or 4 rows (GQA 8 or
    4 decode).

    Key-major with V-lane vectors (`NARROW_LANES`, 8 or 16): per step, one load of the
    head's queries and NK groups of key elements broadcast straight from the cache
    (E = V // R consecutive elements of D, pairs of them with BF16_DOT: 4 to 16 bytes)
    feed NK independent FMAs (`dot_bf16` on V lanes). Lane (r, e) sums every E-th
    element of row r's dot product, so E = 1 needs no horizontal sums and E = 2 or 4
    one or two levels of adjacent-lane adds per key (`_fold_keys`, keys paired so no
    lane is wasted), against 15 shuffles and adds per 16 scores of the 4-row
    butterfly blocks (`_qk_block`). A full block addresses its keys as constant
    displacements from one register (a register per key made LLVM spill three of them)
    and carries the prefetches of its keys' V rows, one or two lines per step.
    With 8 lanes (measured on Zen 4, where they cost no peak: `NARROW_LANES`):
    R = 8, against 8 rows x 2 keys per butterfly, one thread over a 2k context in L3 (4
    KV heads): f32 0.51-0.57 -> 0.45 ms, bf16 0.28-0.29 -> 0.27 ms. R = 4, against the
    4-row butterfly blocks, two threads at 1 x 16k (8 KV heads, medians of five
    alternating runs): f32 4.94 -> 4.51 ms, bf16 2.09 -> 1.97 ms. Keys past n repeat
    key n-1; their scores land in unused slots."""
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    comptime DOT = BF16_DOT[Cache.dtype, D]
    comptime NK = NARROW_KEYS[STRIDE * size_of[Scalar[Cache.dtype]]()]
    comptime E = V // R  # lanes per row
    comptime PAIR = 2 if DOT else 1
    comptime G = E * PAIR  # elements of D per step
    comptime STEPS = D // G
    comptime qdt = DType.bfloat16 if DOT else DType.float32
    # A full block's key offsets are constants (one base register, displacements);
    # the tile's last, partial block repeats key n-1.
    var kb0 = kp.unsafe_offset(j0 * STRIDE)
    var koff = Array[Int, NK](fill=0)
    comptime for kk in range(NK):
        comptime if full:
            koff[kk] = kk * STRIDE
        else:
            koff[kk] = min(kk, n - 1 - j0) * STRIDE
    var qp = qt.unsafe_bitcast[Scalar[qdt]]()
    var acc = Array[SIMD[DType.float32, V], NK](fill=0)
    for st in range(STEPS):
        comptime if full:
            _prefetch_spread[Cache.dtype, NK, D, STRIDE, STEPS](vp.unsafe_offset(j0 * STRIDE), st)
        var qv = qp.unsafe_load[width=V * PAIR](st * V * PAIR)
        comptime for kk in range(NK):
            var group: SIMD[qdt, G]
            comptime if DOT:
                group = rebind[SIMD[qdt, G]](kb0.unsafe_load[width=G](koff[kk] + st * G))
            else:
                group = rebind[SIMD[qdt, G]](widen[width=G](kb0, koff[kk] + st * G))
            var kb = _repeat_group[R](group)
            comptime if DOT:
                acc[kk] = dot_bf16[V](
                    acc[kk], rebind[SIMD[DType.bfloat16, 2 * V]](qv), rebind[SIMD[DType.bfloat16, 2 * V]](kb)
                )
            else:
                acc[kk] = rebind[SIMD[DType.float32, V]](kb).fma(rebind[SIMD[DType.float32, V]](qv), acc[kk])
    comptime for kk in range(0, NK, E):
        var sums = _fold_keys[V, NK, E](acc, kk)
        comptime for e in range(E):
            s.unsafe_store((j0 + kk + e) * MAX_ROWS + r0, sums.slice[R, offset=e * R]())


@always_inline
def _repeat_group[R: Int, dtype: DType, G: Int](group: SIMD[dtype, G]) -> SIMD[dtype, R * G]:
    """The G elements of `group` R times over (a broadcast from memory where `group` is
    a load)."""
    comptime GB = G * size_of[Scalar[dtype]]()
    comptime if GB == 4 or GB == 8:
        comptime udt = DType.uint32 if GB == 4 else DType.uint64
        return bitcast[dtype, R * G](SIMD[udt, R](bitcast[udt, 1](group)))
    elif R == 1:
        return rebind[SIMD[dtype, R * G]](group)
    else:
        var half = _repeat_group[R // 2](group)
        return rebind[SIMD[dtype, R * G]](half.join(half))


def _halves_mask[V: Int, odd: Int]() -> IndexList[V]:
    """Lanes 0, 2, 4, ... (odd = 0) or 1, 3, 5, ... (odd = 1) of concat(a, b)."""
    var m = IndexList[V]()
    for i in range(V):
        m[i] = 2 * i + odd
    return m


@always_inline
def _fold_keys[V: Int, NK: Int, E: Int](acc: Array[SIMD[DType.float32, V], NK], k: Int) -> SIMD[DType.float32, V]:
    """Keys k .. k + E of `acc`, lanes (row, e) with E partial sums per row, summed over
    e: lane e * (V // E) + r of the result is key k + e's score for row r. Each level
    adds adjacent lanes of two vectors (two shuffles and an add)."""
    comptime if E == 1:
        return acc[k]
    else:
        var a = _fold_keys[V, NK, E // 2](acc, k)
        var b = _fold_keys[V, NK, E // 2](acc, k + E // 2)
        return a.shuffle[_halves_mask[V, 0]()](b) + a.shuffle[_halves_mask[V, 1]()](b)


comptime ROW_PAIR_KEYS = 4
"""Keys per `_qk_row_pairs` block: 4 keys x 4 row pairs = 16 accumulators beside the 8
query vectors of a step (2 keys per block: 1.55 vs 1.43-1.47 ms, bf16 GQA 8 1 x 16k)."""


@always_inline
def _store_row_pairs_q[R: Int](head_q: F32Ptr, r: Int, c: Int, qv: SIMD[DType.float32, W]):
    """Stores elements c .. c + W of scaled query row r of a head of R rows where
    `_qk_row_pairs` reads them: per step (W elements of D) and pair of rows, one vector
    of the even elements, then one of the odd ones, each with lanes (row of the pair,
    e), e < 8."""
    var lo = qv.slice[W // 2, offset=0]()
    var hi = qv.slice[W // 2, offset=W // 2]()
    var base = ((c // W) * R + (r % R) // 2 * 2) * W + (r % 2) * (W // 2)
    head_q.unsafe_store(base, lo.shuffle[_halves_mask[W // 2, 0]()](hi))
    head_q.unsafe_store(base + W, lo.shuffle[_halves_mask[W // 2, 1]()](hi))


@always_inline
def _qk_row_pairs[Cache: KVCacheT, R: Int, full: Bool](
    qt: F32Ptr,  # the head's scaled queries in `_store_row_pairs_q`'s order, f32
    s: F32Ptr,  # [BK, MAX_ROWS] scores of this tile, key-major
    r0: Int,  # the head's first row
    kp: Ptr[Cache.dtype],  # the head's first key row of the tile
    vp: Ptr[Cache.dtype],  # the head's first value row of the tile (a full block prefetches its rows as it goes)
    j0: Int,
    n: Int,  # keys in the tile; `full`: j0 + ROW_PAIR_KEYS <= n
):
    """S^T[j0 .. j0 + NK, r0 .. r0 + R] = K Q^T for a head of R = 8 or 4 rows over a
    bf16 cache, on f32 FMAs (`ROW_PAIR_SCORES`: where `vdpbf16ps` runs at half rate).

    A vector holds two rows of 8 lanes. Per step of 16 elements of D, a key's 32 bytes
    are broadcast to both halves of a register and widened in split order: a shift
    makes the even elements f32, a mask the odd ones. Each of the two serves the R / 2
    row pairs' FMAs (query vectors of even and odd elements, `_store_row_pairs_q`), so
    a widening op feeds R / 2 FMAs, where a broadcast key group of `_qk_narrow`'s
    layout (8 rows x 2 lanes) would need one per FMA. Each row's 8 lanes are summed
    with the other rows' and keys' by three levels of two-source shuffles and adds
    (`_fold`, `_fold_keys`). The floor per key row of GQA 8 is then 64 FMAs, 16
    widening ops and ~10 for the sums, ~45 cycles, against 64 for 32 `vdpbf16ps`.
    emeraldrapids, bf16, direct calls (`decode_direct.mojo`), against `_qk_narrow`:
    GQA 8 two threads at 1 x 16k 1.64-1.66 -> 1.45-1.46 ms, one thread in L2 (768
    keys) 141.5 -> 119 us (46 -> 39 ns per key row); GQA 4 (8 KV heads) 2.00 -> 1.82
    ms, in L2 74.2 -> 65.5 us. Q stays f32 (`_qk_narrow` rounds it to bf16), so
    the scores are the f32 products' sums. Keys past n repeat key n-1; their scores
    land in unused slots."""
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    comptime NK = ROW_PAIR_KEYS
    comptime G = R // 2  # row pairs
    comptime E = W // R  # lanes per row once a key's row pairs are summed
    comptime STEPS = D // W
    var kb0 = kp.unsafe_offset(j0 * STRIDE)
    var koff = Array[Int, NK](fill=0)
    comptime for kk in range(NK):
        comptime if full:
            koff[kk] = kk * STRIDE
        else:
            koff[kk] = min(kk, n - 1 - j0) * STRIDE
    var acc = Array[SIMD[DType.float32, W], NK * G](fill=0)  # [kk * G + g]: lanes (row of pair g, e)
    for st in range(STEPS):
        comptime if full:
            _prefetch_spread[Cache.dtype, NK, D, STRIDE, STEPS](vp.unsafe_offset(j0 * STRIDE), st)
        var q = Array[SIMD[DType.float32, W], 2 * G](fill=0)  # [2 g]: even elements, [2 g + 1]: odd
        comptime for i in range(2 * G):
            q[i] = qt.unsafe_load[width=W]((st * 2 * G + i) * W)
        comptime for kk in range(NK):
            var words = bitcast[DType.uint32, W // 2](kb0.unsafe_load[width=W](koff[kk] + st * W))
            var both = words.join(words)
            var even = widen_even(both)
            var odd = widen_odd(both)
            comptime for g in range(G):
                acc[kk * G + g] = q[2 * g].fma(even, acc[kk * G + g])
                acc[kk * G + g] = q[2 * g + 1].fma(odd, acc[kk * G + g])
    var per_key = Array[SIMD[DType.float32, W], NK](fill=0)  # lanes (row, e): R rows of E lanes
    comptime for kk in range(NK):
        var quads = Array[SIMD[DType.float32, W], G // 2](fill=0)  # 4 rows of 4 lanes
        comptime for h in range(G // 2):
            quads[h] = _fold[8](acc[kk * G + 2 * h], acc[kk * G + 2 * h + 1])
        comptime if G == 4:
            per_key[kk] = _fold[4](quads[0], quads[1])
        else:
            per_key[kk] = quads[0]
    comptime for kk in range(0, NK, E):
        var sums = _fold_keys[W, NK, E](per_key, kk)
        comptime for e in range(E):
            s.unsafe_store((j0 + kk + e) * MAX_ROWS + r0, sums.slice[R, offset=e * R]())


def _group_keys[Cache: KVCacheT]() -> Int:
    """Keys per score block of a GQA 8 or 4 head (`_qk_group`)."""
    comptime if ROW_PAIR_SCORES[Cache.dtype, Cache.kv_params.head_size]:
        return ROW_PAIR_KEYS
    return NARROW_KEYS[Cache.token_stride() * size_of[Scalar[Cache.dtype]]()]


@always_inline
def _store_group_q[Cache: KVCacheT, R: Int](head_q: F32Ptr, r: Int, c: Int, qv: SIMD[DType.float32, W]):
    """Stores elements c .. c + W of scaled query row r of a head of R = 8 or 4 rows
    where `_qk_group` reads them."""
    comptime D = Cache.kv_params.head_size
    comptime if ROW_PAIR_SCORES[Cache.dtype, D]:
        _store_row_pairs_q[R](head_q, r, c, qv)
    else:
        _store_narrow_q[R, BF16_DOT[Cache.dtype, D]](head_q, r, c, qv)


@always_inline
def _qk_group[Cache: KVCacheT, R: Int, full: Bool](
    qt: F32Ptr, s: F32Ptr, r0: Int, kp: Ptr[Cache.dtype], vp: Ptr[Cache.dtype], j0: Int, n: Int
):
    """The scores of one block of `_group_keys` keys for a head of R = 8 or 4 rows, in
    the form this CPU runs fastest (arguments as `_qk_narrow`'s)."""
    comptime if ROW_PAIR_SCORES[Cache.dtype, Cache.kv_params.head_size]:
        _qk_row_pairs[Cache, R, full](qt, s, r0, kp, vp, j0, n)
    else:
        _qk_narrow[Cache, R, full](qt, s, r0, kp, vp, j0, n)


@always_inline
def _pv_block[
    dtype: DType, D: Int, STRIDE: Int, rb: Int = RB, DOT: Bool = BF16_PV_DOT[dtype, D], SPLIT: Bool = SPLIT_PV[dtype, D]
](
    o: F32Ptr,  # [rows, D] output accumulators
    p: F32Ptr,  # probabilities of this tile, key-major: P[r, j] at j * MAX_ROWS + r
    r0: Int,
    vp: Ptr[dtype],  # first value row of the tile; rows STRIDE apart
    n: Int,
    pf: Ptr[dtype],  # rows to prefetch into L2, the columns of V being read (the next tile's K)
    pf_n: Int,  # rows of pf (0: no prefetch)
):
    """O[r0 .. r0+rb] += P[r0 .. r0+rb, :n] . V[:n], NC 16-lane column chunks per pass:
    rb*NC = 16 accumulators, and each loaded V chunk / broadcast p serves NC / rb FMAs.
    rb = 8 (a GQA-8 head's rows) widens each bf16 V chunk once instead of twice.
    With SPLIT (`SPLIT_PV`), a bf16 V chunk pair is widened by one shift and one mask
    into its even and odd columns, and O's columns are kept in that order (`O_SPLIT`).
    With DOT (`BF16_PV_DOT`), p holds bf16 pairs (P[r, j], P[r, j+1]) in 32-bit slots
    ((j // 2) * MAX_ROWS + r, from `_softmax_key_major`) and a step takes two keys: V
    rows j and j+1 interleaved are the adjacent pairs `dot_bf16` multiplies (row n-1
    repeats for an odd n, times 0). They are interleaved within 128-bit lanes (one
    `vpunpck{l,h}wd` per 32 columns and key pair, where a cross-lane interleave took
    two shuffles per 16 columns), so O's columns are kept in that paired order
    (`_pair_keys_mask`) until the unit's output (`_o_natural`). One thread, cache in
    L2 (medians of three alternating runs): bf16 GQA 8 29.4 -> 27.5 us, GQA 4 35.3 ->
    33.6 us, GQA 1 78.7 -> 75.7 us; GQA 8 two threads at 1 x 16k 1.08 -> 1.05 ms.
    Each step prefetches the same columns of pf's rows."""
    comptime KSTEP = 2 if DOT else 1
    comptime NC = _pv_chunks(W // rb, D)
    comptime assert not DOT or NC % 2 == 0, "BF16_DOT pairs V columns 32 at a time"
    comptime for c0 in range(0, D, NC * W):
        var acc = Array[SIMD[DType.float32, W], rb * NC](fill=0)
        for j in range(0, n, KSTEP):
            if j < pf_n:
                _prefetch_spread[dtype, KSTEP, NC * W, STRIDE, 1](pf.unsafe_offset(j * STRIDE + c0), 0)
            comptime if DOT:
                var j1 = min(j + 1, n - 1)
                var vv = Array[SIMD[DType.bfloat16, 2 * W], NC](fill=0)
                comptime for cc in range(0, NC, 2):
                    var v0 = vp.unsafe_load[width=2 * W](j * STRIDE + c0 + cc * W)
                    var v1 = vp.unsafe_load[width=2 * W](j1 * STRIDE + c0 + cc * W)
                    vv[cc] = rebind[SIMD[DType.bfloat16, 2 * W]](v0.shuffle[_pair_keys_mask[0]()](v1))
                    vv[cc + 1] = rebind[SIMD[DType.bfloat16, 2 * W]](v0.shuffle[_pair_keys_mask[1]()](v1))
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
                comptime for rr in range(rb):
                    var pj = SIMD[DType.float32, W](p.unsafe_load(j * MAX_ROWS + r0 + rr))
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
    var m = IndexList[2 * W]()
    for t in range(2 * W):
        m[t] = (t // 8) * 8 + hi * 4 + (t % 8) // 2 + (t % 2) * 2 * W
    return m


def _natural_columns_mask[half: Int]() -> IndexList[W]:
    """Lanes of concat(lo, hi), 32 O columns in paired order (`_pair_keys_mask`),
    that hold natural columns half * 16 .. half * 16 + 16."""
    var m = IndexList[W]()
    for t in range(W):
        m[t] = (W if t % 8 >= 4 else 0) + half * 8 + (t // 8) * 4 + t % 4
    return m


@always_inline
def _split_columns_mask[half: Int]() -> IndexList[W]:
    """Lanes of concat(even, odd), 32 O columns in split order, that hold natural
    columns half * 16 .. half * 16 + 16."""
    var m = IndexList[W]()
    for t in range(W):
        m[t] = (t % 2) * W + half * (W // 2) + t // 2
    return m


comptime O_NATURAL = 0
"""O's columns as in the output (prefill units, f32 decode units)."""
comptime O_PAIRED = 1
"""O's columns in the order of `dot_bf16` P V (`_pair_keys_mask`)."""
comptime O_SPLIT = 2
"""O's columns even then odd per 32 (`SPLIT_PV`)."""


@always_inline
def _o_natural[D: Int](o: F32Ptr, r: Int, c: Int, order: Int) -> SIMD[DType.float32, W]:
    """O[r, c .. c + W] in natural column order, from O kept in `order` (`O_NATURAL`,
    `O_PAIRED` or `O_SPLIT`)."""
    if order == O_NATURAL:
        return o.unsafe_load[width=W](r * D + c)
    var c0 = c - c % (2 * W)
    var lo = o.unsafe_load[width=W](r * D + c0)
    var hi = o.unsafe_load[width=W](r * D + c0 + W)
    if order == O_SPLIT:
        if c == c0:
            return lo.shuffle[_split_columns_mask[0]()](hi)
        return lo.shuffle[_split_columns_mask[1]()](hi)
    if c == c0:
        return lo.shuffle[_natural_columns_mask[0]()](hi)
    return lo.shuffle[_natural_columns_mask[1]()](hi)


def _pv_chunks(most: Int, D: Int) -> Int:
    """Column chunks per P V pass: the largest power of two up to `most` dividing D // W
    (`most` = 16 // rb, so rb * NC <= 16 accumulators)."""
    var nc = most
    while nc > 1 and D % (nc * W) != 0:
        nc //= 2
    return nc


@always_inline
def _stage_tile[Cache: KVCacheT](dst: F32Ptr, src: Ptr[Cache.dtype], n: Int):
    """Copies n rows of one head (`token_stride` apart in the cache) into contiguous
    f32 [n, D]. Key-major units read a tile once per 16-row block: staged, it is
    widened once and sits in L1 (one head's rows a whole token apart all map to the
    same few L1 sets)."""
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    for j in range(n):
        comptime for c in range(0, D, W):
            dst.unsafe_store(j * D + c, widen(src, j * STRIDE + c))


@always_inline
def _rescale_row[D: Int](o: F32Ptr, r: Int, alpha: Float32):
    """O[r] *= alpha, the online-softmax correction when a row's running max grows."""
    if alpha != 1:
        comptime for c in range(0, D, W):
            o.unsafe_store(r * D + c, o.unsafe_load[width=W](r * D + c) * alpha)


def _softmax_key_major[D: Int, PAIRS: Bool](
    s: F32Ptr,  # [BK, MAX_ROWS] scores S^T[j, r] of this tile, in log2 units
    m: F32Ptr,  # [MAX_ROWS] running maxima (the reference P is taken against)
    l: F32Ptr,  # [MAX_ROWS] running sums
    o: F32Ptr,  # [MAX_ROWS, D] output accumulators
    last: I32Ptr,  # [MAX_ROWS] each row's last visible position
    rows: Int,
    n: Int,
    k_tok: Int,  # position of the tile's first key
    masked: Bool,
    pb: F32Ptr,  # PAIRS: [BK // 2, MAX_ROWS] bf16 pairs of P
):
    """One online-softmax step over a tile's key-major scores, W rows at a time:
    maxima, masks and sums are lane-wise, with no horizontal reductions. P replaces
    the scores in s or, with PAIRS (`_pv_block`'s BF16_DOT input), goes to pb rounded
    to bf16 pairs (P[r, j], P[r, j+1]) in 32-bit slots (j // 2) * MAX_ROWS + r, with
    P[r, n] = 0 for an odd n (rows up to a multiple of W: padding rows hold junk, never
    used). Rounding in the exp pass saves a pass over P; the maximum runs in four
    chains, where one was bound by the latency of a NaN-aware `max` (bf16 GQA 8, one
    thread: 16.4 -> 16.9 GB/s with the cache in L2, 2.27 -> 2.08 ms at 16k).

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
            for j in range(n):
                var v = s.unsafe_load[width=W](j * MAX_ROWS + r0)
                v = SIMD[DType.int32, W](k_tok + j).gt(last_v).select(SIMD[DType.float32, W](Float32.MIN), v)
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


@fieldwise_init
struct _Unit(ImplicitlyCopyable, Movable):
    """One task of the CPU path: `ntok` new tokens of batch entry `b` (flat tokens from
    `tok0`, entry-relative from `i0`) x KV heads [h0, h0 + nh), against the keys
    [k_lo, k_hi). With `part` < 0 the unit sees all its keys and writes the output;
    otherwise it is one split of them and leaves its unnormalised softmax state in
    partial slot `part`, and the last split of `merge` to finish runs `_merge_parts`."""

    var b: Int
    var tok0: Int
    var i0: Int
    var ntok: Int
    var h0: Int
    var nh: Int
    var k_lo: Int
    var k_hi: Int
    var part: Int
    var merge: Int


@fieldwise_init
struct _Merge(ImplicitlyCopyable, Movable):
    """A unit whose keys were split: its splits left their states in partial slots
    [unit.part, unit.part + parts)."""

    var unit: _Unit
    var parts: Int


@always_inline
def _head_rows(ntok: Int, group: Int) -> Int:
    """Rows one KV head contributes to a unit: ntok x group, padded to a multiple of W
    when there are at least W (prefill's staged scores), else of RB (decode's 4-, 8-
    and 12-row forms); a single row (GQA 1 decode) is not padded. Padding rows get zero
    queries and finite junk, and are never stored."""
    var rows = ntok * group
    if rows == 1:  # one decode token of plain multi-head attention: 1-row blocks
        return 1
    return ceildiv(rows, W) * W if rows >= W else ceildiv(rows, RB) * RB


@always_inline
def _row_offset(u: _Unit, r: Int, group: Int, n_q: Int, D: Int) -> Int:
    """Element offset in q / output of unit row r (rows are KV-head-major, then token,
    then query head of the group). -1 for a padding row."""
    var rows_hp = _head_rows(u.ntok, group)
    var rr = r % rows_hp
    if rr >= u.ntok * group:
        return -1
    return ((u.tok0 + rr // group) * n_q + (u.h0 + r // rows_hp) * group + rr % group) * D


def _attend_unit[Cache: KVCacheT, q_dtype: DType](
    kc: Cache,
    vc: Cache,
    q: Ptr[q_dtype],  # [total_tokens, n_q, D]
    output: Ptr[q_dtype],  # [total_tokens, n_q, D]
    u: _Unit,
    group: Int,
    n_q: Int,
    scale: Float32,
    parts: F32Ptr,  # partial slots, PART_SLOT[D] floats each
):
    """Online-softmax attention of one unit: all its rows share one pass over its keys.

    Each key tile takes three steps: the scores S^T [keys, rows] (prefill units, with
    at least W rows per head, from f32-staged tiles; decode units from K as stored, in
    the form that fits their rows per head), one lane-wise online-softmax step, and
    O += P V head by head. Decode units walk several heads per key tile.
    """
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    comptime assert D % W == 0, "head_size must be a multiple of 16 on CPU"
    comptime DOT = BF16_DOT[Cache.dtype, D]
    var rows_hp = _head_rows(u.ntok, group)
    var rows_p = u.nh * rows_hp
    var key_major = rows_hp % W == 0
    var narrow = rows_hp == 8 or rows_hp == 4  # scores of a GQA 8 or 4 head from K as stored (`_qk_group`)
    var paired = BF16_PV_DOT[Cache.dtype, D] and not key_major  # P V with `dot_bf16`: O's columns in paired order
    var order = O_PAIRED if paired else (O_SPLIT if SPLIT_PV[Cache.dtype, D] and not key_major else O_NATURAL)
    var qs = stack_allocation[MAX_ROWS * D, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var o = stack_allocation[MAX_ROWS * D, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var s = stack_allocation[MAX_ROWS * BK, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var kf = stack_allocation[BK * D, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()  # a staged K or V tile
    var pb = stack_allocation[MAX_ROWS * BK // 2, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()  # bf16 P pairs
    var m = stack_allocation[MAX_ROWS, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var l = stack_allocation[MAX_ROWS, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var last = stack_allocation[MAX_ROWS, Int32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var first_pos = kc.cache_length(u.b) + u.i0  # position of the unit's first token
    var scale_log2 = scale * LOG2E  # scores in log2 units: the softmax takes powers of 2
    for r in range(rows_p):
        var off = _row_offset(u, r, group, n_q, D)
        comptime for c in range(0, D, W):
            var qv = SIMD[DType.float32, W](0)
            if off >= 0:
                qv = q.unsafe_load[width=W](off + c).cast[DType.float32]() * scale_log2
            if key_major:  # qs is Q^T [D, MAX_ROWS]
                comptime for i in range(W):
                    qs.unsafe_store((c + i) * MAX_ROWS + r, qv[i])
            elif narrow:  # per head, in `_qk_group`'s lane order
                var head_q = qs.unsafe_offset((r // rows_hp) * rows_hp * D)
                if rows_hp == 8:
                    _store_group_q[Cache, 8](head_q, r, c, qv)
                else:
                    _store_group_q[Cache, 4](head_q, r, c, qv)
            else:  # qs is Q [rows, D], in bf16 for `dot_bf16` scores
                comptime if DOT:
                    qs.unsafe_bitcast[BFloat16]().unsafe_store(r * D + c, qv.cast[DType.bfloat16]())
                else:
                    qs.unsafe_store(r * D + c, qv)
            o.unsafe_store(r * D + c, SIMD[DType.float32, W](0))
        m.unsafe_store(r, Float32.MIN)
        l.unsafe_store(r, 0)
        last.unsafe_store(r, Int32(first_pos + (r % rows_hp) // group))
    # The key-major softmax takes W rows at a time: give padding rows a finite state.
    for r in range(rows_p, ceildiv(rows_p, W) * W):
        comptime for c in range(0, D, W):
            o.unsafe_store(r * D + c, SIMD[DType.float32, W](0))
        m.unsafe_store(r, Float32.MIN)
        l.unsafe_store(r, 0)
        last.unsafe_store(r, Int32(first_pos))
        for j in range(BK):
            s.unsafe_store(j * MAX_ROWS + r, 0)

    # Keys per tile: one head's K tile stays in L1 while every row block of the head
    # walks it (the two sizes are measured choices: see the module docstring).
    comptime TK_STORED = max(KB, min(BK, 8192 // (D * size_of[Scalar[Cache.dtype]]())))
    comptime TK_STAGED = max(KB, min(BK, 16384 // (D * 4)))
    var tile_keys = TK_STAGED if key_major else TK_STORED
    var width = u.nh * D  # elements of one token's rows for the unit's heads: contiguous
    var kv_end = min(u.k_hi, first_pos + u.ntok)
    var k_tok = u.k_lo
    _prefetch_rows[Cache](kc.row_ptr(u.b, u.h0, k_tok), min(tile_keys, kc.contiguous_tokens(k_tok), kv_end - k_tok), width)
    while k_tok < kv_end:
        var n = min(tile_keys, kc.contiguous_tokens(k_tok), kv_end - k_tok)
        var kp = kc.row_ptr(u.b, u.h0, k_tok)
        var vp = vc.row_ptr(u.b, u.h0, k_tok)
        var k_next = k_tok + n
        var n_next = min(tile_keys, kc.contiguous_tokens(k_next), kv_end - k_next) if k_next < kv_end else 0
        var kp_next = kc.row_ptr(u.b, u.h0, k_next) if n_next > 0 else kp
        # Prefetches are spread over the tile's work, so that the memory system always
        # has misses in flight: V rows while K rows are read (scores), each head's next
        # K rows while its V rows are read (P V).
        var masked = k_tok + n - 1 > first_pos  # the diagonal tile: some keys are in the future
        if key_major:
            for hh in range(u.nh):
                _prefetch_rows[Cache](vp.unsafe_offset(hh * D), n, D)
                _stage_tile[Cache](kf, kp.unsafe_offset(hh * D), n)
                var r = hh * rows_hp
                var r_end = r + rows_hp
                while r < r_end:
                    if r_end - r >= 4 * W:
                        _qk_key_major[D, 4](qs, kf, s, r, n)
                        r += 4 * W
                    elif r_end - r >= 2 * W:
                        _qk_key_major[D, 2](qs, kf, s, r, n)
                        r += 2 * W
                    else:
                        _qk_key_major[D, 1](qs, kf, s, r, n)
                        r += W
        elif narrow:
            # Key blocks outer, heads inner: the tile is read in address order (a
            # token's heads are adjacent), which the hardware prefetchers follow.
            comptime NK = _group_keys[Cache]()
            for j0 in range(0, n, NK):
                for hh in range(u.nh):
                    var qh = qs.unsafe_offset(hh * rows_hp * D)
                    var r0 = hh * rows_hp
                    var kh = kp.unsafe_offset(hh * D)
                    var vh = vp.unsafe_offset(hh * D)
                    if j0 + NK > n:
                        _prefetch_rows[Cache](vh.unsafe_offset(j0 * STRIDE), n - j0, D)
                        if rows_hp == 8:
                            _qk_group[Cache, 8, False](qh, s, r0, kh, vh, j0, n)
                        else:
                            _qk_group[Cache, 4, False](qh, s, r0, kh, vh, j0, n)
                    elif rows_hp == 8:
                        _qk_group[Cache, 8, True](qh, s, r0, kh, vh, j0, n)
                    else:
                        _qk_group[Cache, 4, True](qh, s, r0, kh, vh, j0, n)
        elif rows_hp == 1:  # GQA 1 decode: key by key, 16 heads at a time, in address order
            for j in range(n):
                for h0 in range(0, u.nh, W):
                    _qk_heads[Cache](qs, s, h0, u.nh, kp, vp, j)
        else:  # key blocks outer, heads inner, as above
            for j0 in range(0, n, KB):
                for hh in range(u.nh):
                    _prefetch_rows[Cache](vp.unsafe_offset(j0 * STRIDE + hh * D), min(KB, n - j0), D)
                    for r0 in range(hh * rows_hp, (hh + 1) * rows_hp, RB):
                        _qk_block[Cache](qs, s, r0, kp.unsafe_offset(hh * D), j0, n)
        if paired:
            _softmax_key_major[D, True](s, m, l, o, last, rows_p, n, k_tok, masked, pb)
        else:
            _softmax_key_major[D, False](s, m, l, o, last, rows_p, n, k_tok, masked, pb)

        if key_major:
            for hh in range(u.nh):
                _prefetch_rows[Cache](kp_next.unsafe_offset(hh * D), n_next, D)
                _stage_tile[Cache](kf, vp.unsafe_offset(hh * D), n)
                for r0 in range(hh * rows_hp, (hh + 1) * rows_hp, RB):
                    _pv_block[DType.float32, D, D](o, s, r0, kf, n, kf, 0)
        else:
            var p = pb if paired else s
            for hh in range(u.nh):
                var vh = vp.unsafe_offset(hh * D)
                var kh = kp_next.unsafe_offset(hh * D)
                if rows_hp == 8:
                    _pv_block[Cache.dtype, D, STRIDE, 8](o, p, hh * 8, vh, n, kh, n_next)
                elif rows_hp == 1:
                    _pv_block[Cache.dtype, D, STRIDE, 1](o, p, hh, vh, n, kh, n_next)
                else:
                    for r0 in range(hh * rows_hp, (hh + 1) * rows_hp, RB):
                        _pv_block[Cache.dtype, D, STRIDE](o, p, r0, vh, n, kh, n_next if r0 == hh * rows_hp else 0)
        k_tok += n

    if u.part >= 0:  # one split of the keys: keep the raw state for the merge
        var slot = parts.unsafe_offset(u.part * PART_SLOT[D])
        for r in range(rows_p):
            comptime for c in range(0, D, W):
                slot.unsafe_store(r * D + c, _o_natural[D](o, r, c, order))
            slot.unsafe_store(MAX_ROWS * D + r, m.unsafe_load(r))
            slot.unsafe_store(MAX_ROWS * (D + 1) + r, l.unsafe_load(r))
        return
    for r in range(rows_p):
        var off = _row_offset(u, r, group, n_q, D)
        if off < 0:
            continue
        var inv = 1 / l.unsafe_load(r)
        comptime for c in range(0, D, W):
            output.unsafe_store(off + c, (_o_natural[D](o, r, c, order) * inv).cast[q_dtype]())


def _merge_parts[q_dtype: DType, D: Int](
    mg: _Merge, parts: F32Ptr, output: Ptr[q_dtype], group: Int, n_q: Int
):
    """Combines the softmax states of a unit's key splits: with M the largest running
    max, out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s."""
    var u = mg.unit
    for r in range(u.nh * _head_rows(u.ntok, group)):
        var off = _row_offset(u, r, group, n_q, D)
        if off < 0:
            continue
        var mx = Float32.MIN
        for p in range(mg.parts):
            mx = max(mx, parts.unsafe_load((u.part + p) * PART_SLOT[D] + MAX_ROWS * D + r))
        var acc = Array[SIMD[DType.float32, W], D // W](fill=0)
        var l: Float32 = 0
        for p in range(mg.parts):
            var slot = parts.unsafe_offset((u.part + p) * PART_SLOT[D])
            var w = exp2[5](SIMD[DType.float32, W](slot.unsafe_load(MAX_ROWS * D + r) - mx))[0]
            l += w * slot.unsafe_load(MAX_ROWS * (D + 1) + r)
            comptime for c in range(D // W):
                acc[c] = SIMD[DType.float32, W](w).fma(slot.unsafe_load[width=W](r * D + c * W), acc[c])
        comptime for c in range(D // W):
            output.unsafe_store(off + c * W, (acc[c] / l).cast[q_dtype]())


@always_inline
def _nearest_tile(keys: Int) -> Int:
    """`keys` rounded to the nearest multiple of SPLIT_ALIGN."""
    return (keys + SPLIT_ALIGN // 2) // SPLIT_ALIGN * SPLIT_ALIGN


def _plan_units[Cache: KVCacheT](
    kc: Cache, offsets: U32Ptr, batch_size: Int, group: Int, mut units: List[_Unit], mut merges: List[_Merge]
) raises -> Int:
    """Cuts the batch into units and returns the number of partial slots they use.

    Each entry's new tokens go in tiles of at most MAX_ROWS // group tokens. A tile
    takes as many KV heads as fit in MAX_ROWS rows: one head for a prefill tile, all
    of them for a decode token with group <= 8, so that decode walks each key tile's
    heads in address order. When that leaves too few units to keep every core busy
    (a few long decodes), the keys each unit's rows all see are split, at least
    MIN_SPLIT_KEYS apiece, and the last split of each to finish merges them.
    """
    comptime H = Cache.kv_params.num_heads
    if group > MAX_ROWS:
        raise Error("mokv flash_attention (CPU): n_q / n_kv_heads must be <= ", MAX_ROWS)
    var tq = max(1, MAX_ROWS // group)
    var whole = List[_Unit]()
    for b in range(batch_size):
        var start = Int(offsets[unsafe_offset=b])
        var end = Int(offsets[unsafe_offset=b + 1])
        var t = start
        while t < end:
            var ntok = min(tq, end - t)
            var nh = H
            while nh * _head_rows(ntok, group) > MAX_ROWS or H % nh != 0:
                nh -= 1
            var first_pos = kc.cache_length(b) + t - start
            for h0 in range(0, H, nh):
                whole.append(_Unit(b, t, t - start, ntok, h0, nh, 0, first_pos + ntok, -1, -1))
            t += ntok

    var want = ceildiv(SPLIT_UNITS_PER_CORE * num_physical_cores(), max(len(whole), 1))
    var n_parts = 0
    for u in whole:
        # Keys [0, shared) are visible to every row, so every split has a visible key.
        var shared = u.k_hi - u.ntok + 1
        var splits = min(want, shared // MIN_SPLIT_KEYS)
        if splits <= 1:
            units.append(u)
            continue
        # Boundaries at i * shared / splits, each rounded to the nearest whole tile, so the
        # splits differ by at most a tile. (A step rounded up to whole tiles left fewer,
        # longer splits and a short last one: 13 at 1 x 4096, so one core ran 7 of them and
        # the other 6, idle for the last ~40 us of a ~470 us call in a graph.)
        var lo = 0
        for i in range(splits):
            var hi = u.k_hi if i == splits - 1 else _nearest_tile(((i + 1) * shared) // splits)
            units.append(_Unit(u.b, u.tok0, u.i0, u.ntok, u.h0, u.nh, lo, hi, n_parts + i, len(merges)))
            lo = hi
        merges.append(_Merge(_Unit(u.b, u.tok0, u.i0, u.ntok, u.h0, u.nh, 0, u.k_hi, n_parts, -1), splits))
        n_parts += splits
    return n_parts


def flash_attention[Coll: KVCollectionT, q_dtype: DType, target: StaticString, tensor_cores: Bool = False](
    coll: Coll,
    output: Ptr[q_dtype],  # [total_tokens, n_q, D]
    q: Ptr[q_dtype],  # [total_tokens, n_q, D]
    offsets: U32Ptr,  # [batch_size + 1]
    total_tokens: Int,
    n_q: Int,
    layer_idx: Int,
    scale: Float32,
    ctx: DeviceContext,
) raises:
    """Generic body of `mokv.flash_attention.ragged.*`. `tensor_cores`: on an NVIDIA GPU,
    units of 4 or 8 heads over bf16/f16 caches take `gpu_attention_mma` (staged, see there)."""
    comptime Cache = Coll.CacheType
    comptime H = Cache.kv_params.num_heads
    comptime D = Cache.kv_params.head_size
    var kc = coll.get_key_cache(layer_idx)
    var vc = coll.get_value_cache(layer_idx)
    var batch_size = coll.batch_size()
    var group = n_q // H

    comptime if is_cpu[target]():
        var units = List[_Unit]()
        var merges = List[_Merge]()
        var n_parts = _plan_units(kc, offsets, batch_size, group, units, merges)
        # Partial slots are written by their split before the merge reads them: no fill.
        var scratch = List[Float32](capacity=max(n_parts, 1) * PART_SLOT[D])
        var parts = scratch.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var pending = List[Int64](capacity=len(merges))  # per merge: splits still running
        for mg in merges:
            pending.append(Int64(mg.parts))
        var pending_ptr = pending.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var unit_ptr = units.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var merge_ptr = merges.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

        # The last split of a unit to finish merges it, so the merges need no second
        # parallel pass: that pass's dispatch and the zero fill of the partial slots
        # cost ~1 % of bf16 GQA 8 decode at 1 x 4096 (0.283 -> 0.279 ms, direct calls,
        # medians of five alternating runs). The atomic (sequentially consistent)
        # makes the other splits' slots visible to the merging one.
        def body(i: Int) {
            imm kc, imm vc, imm q, imm output, imm unit_ptr, imm merge_ptr, imm pending_ptr,
            imm group, imm n_q, imm scale, imm parts
        }:
            var u = unit_ptr[unsafe_offset=i]
            _attend_unit(kc, vc, q, output, u, group, n_q, scale, parts)
            if u.merge >= 0 and Atomic[Int64].fetch_add(pending_ptr.unsafe_offset(u.merge), -1) == 1:
                _merge_parts[q_dtype, D](merge_ptr[unsafe_offset=u.merge], parts, output, group, n_q)

        parallel_units(body, len(units), ctx)
        _ = pending^
        _ = units^  # keep the tables and partial states alive until every task has run
        _ = merges^
        _ = scratch^
    else:
        # Heads per unit: a comptime parameter (their states live in registers).
        var gb = heads_per_unit(group)
        comptime if tensor_cores and tensor_core_cache_ok[Cache.dtype, D]() and Cache.dtype == q_dtype:
            if gb >= 4 and ctx.api() == "cuda":
                if gb == 8:
                    gpu_attention_mma[Cache, q_dtype, 8](kc, vc, output, q, offsets, total_tokens, n_q, group, scale, ctx)
                else:
                    gpu_attention_mma[Cache, q_dtype, 4](kc, vc, output, q, offsets, total_tokens, n_q, group, scale, ctx)
                return
        if gb == 8:
            gpu_attention[Cache, q_dtype, 8](kc, vc, output, q, offsets, total_tokens, n_q, group, scale, ctx)
        elif gb == 4:
            gpu_attention[Cache, q_dtype, 4](kc, vc, output, q, offsets, total_tokens, n_q, group, scale, ctx)
        elif gb == 2:
            gpu_attention[Cache, q_dtype, 2](kc, vc, output, q, offsets, total_tokens, n_q, group, scale, ctx)
        else:
            gpu_attention[Cache, q_dtype, 1](kc, vc, output, q, offsets, total_tokens, n_q, group, scale, ctx)
