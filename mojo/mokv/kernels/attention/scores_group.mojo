"""Decode scores of a GQA 8 or 4 head (8 or 4 query rows per KV head), read from K as
stored: broadcast key groups into narrow vectors (`qk_narrow`) or, where `vdpbf16ps`
runs at half rate, two rows per vector over keys widened in registers
(`qk_row_pairs`); `qk_group` picks the form the build target runs fastest."""

from std.memory import bitcast
from std.sys.info import size_of
from std.utils.index import IndexList

from ...types import KVCacheT, Ptr
from ..cpu import W
from ..simd import F32Ptr, _fold, dot_bf16, widen, widen_even, widen_odd
from .forms import BF16_DOT, MAX_ROWS, NARROW_KEYS, NARROW_LANES, ROW_PAIR_SCORES
from .tiles import prefetch_spread


@always_inline
def store_narrow_q[R: Int, DOT: Bool, V: Int = NARROW_LANES](
    head_q: F32Ptr, r: Int, c: Int, qv: SIMD[DType.float32, W]
):
    """Stores elements c .. c + W of scaled query row r of a head of R rows where
    `qk_narrow` reads them: in steps of V lanes, lane (r, e) holding PAIR consecutive
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
def qk_narrow[Cache: KVCacheT, R: Int, full: Bool, V: Int = NARROW_LANES](
    qt: F32Ptr,  # the head's scaled queries in lane order (`store_narrow_q`), f32 or (BF16_DOT) bf16
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
    butterfly blocks (`qk_block`). A full block addresses its keys as constant
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
            prefetch_spread[Cache.dtype, NK, D, STRIDE, STEPS](vp.unsafe_offset(j0 * STRIDE), st)
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
"""Keys per `qk_row_pairs` block: 4 keys x 4 row pairs = 16 accumulators beside the 8
query vectors of a step (2 keys per block: 1.55 vs 1.43-1.47 ms, bf16 GQA 8 1 x 16k)."""


@always_inline
def store_row_pairs_q[R: Int](head_q: F32Ptr, r: Int, c: Int, qv: SIMD[DType.float32, W]):
    """Stores elements c .. c + W of scaled query row r of a head of R rows where
    `qk_row_pairs` reads them: per step (W elements of D) and pair of rows, one vector
    of the even elements, then one of the odd ones, each with lanes (row of the pair,
    e), e < 8."""
    comptime assert W == 16, "row pairs are two rows of 8 lanes in one 16-lane vector"
    var lo = qv.slice[W // 2, offset=0]()
    var hi = qv.slice[W // 2, offset=W // 2]()
    var base = ((c // W) * R + (r % R) // 2 * 2) * W + (r % 2) * (W // 2)
    head_q.unsafe_store(base, lo.shuffle[_halves_mask[W // 2, 0]()](hi))
    head_q.unsafe_store(base + W, lo.shuffle[_halves_mask[W // 2, 1]()](hi))


@always_inline
def qk_row_pairs[Cache: KVCacheT, R: Int, full: Bool](
    qt: F32Ptr,  # the head's scaled queries in `store_row_pairs_q`'s order, f32
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
    row pairs' FMAs (query vectors of even and odd elements, `store_row_pairs_q`), so
    a widening op feeds R / 2 FMAs, where a broadcast key group of `qk_narrow`'s
    layout (8 rows x 2 lanes) would need one per FMA. Each row's 8 lanes are summed
    with the other rows' and keys' by three levels of two-source shuffles and adds
    (`_fold`, `_fold_keys`). The floor per key row of GQA 8 is then 64 FMAs, 16
    widening ops and ~10 for the sums, ~45 cycles, against 64 for 32 `vdpbf16ps`.
    emeraldrapids, bf16, direct calls (`decode_direct.mojo`), against `qk_narrow`:
    GQA 8 two threads at 1 x 16k 1.64-1.66 -> 1.45-1.46 ms, one thread in L2 (768
    keys) 141.5 -> 119 us (46 -> 39 ns per key row); GQA 4 (8 KV heads) 2.00 -> 1.82
    ms, in L2 74.2 -> 65.5 us. Q stays f32 (`qk_narrow` rounds it to bf16), so
    the scores are the f32 products' sums. Keys past n repeat key n-1; their scores
    land in unused slots."""
    comptime assert W == 16, "row pairs are two rows of 8 lanes in one 16-lane vector"
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
            prefetch_spread[Cache.dtype, NK, D, STRIDE, STEPS](vp.unsafe_offset(j0 * STRIDE), st)
        var q = Array[SIMD[DType.float32, W], 2 * G](fill=0)  # [2 g]: even elements, [2 g + 1]: odd
        comptime for i in range(2 * G):
            q[i] = qt.unsafe_load[width=W]((st * 2 * G + i) * W)
        comptime for kk in range(NK):
            var words = bitcast[DType.uint32, W // 2](kb0.unsafe_load[width=W](koff[kk] + st * W))
            var both = rebind[SIMD[DType.uint32, W]](words.join(words))
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


def group_keys[Cache: KVCacheT]() -> Int:
    """Keys per score block of a GQA 8 or 4 head (`qk_group`)."""
    comptime if ROW_PAIR_SCORES[Cache.dtype, Cache.kv_params.head_size]:
        return ROW_PAIR_KEYS
    return NARROW_KEYS[Cache.token_stride() * size_of[Scalar[Cache.dtype]]()]


@always_inline
def store_group_q[Cache: KVCacheT, R: Int](head_q: F32Ptr, r: Int, c: Int, qv: SIMD[DType.float32, W]):
    """Stores elements c .. c + W of scaled query row r of a head of R = 8 or 4 rows
    where `qk_group` reads them."""
    comptime D = Cache.kv_params.head_size
    comptime if ROW_PAIR_SCORES[Cache.dtype, D]:
        store_row_pairs_q[R](head_q, r, c, qv)
    else:
        store_narrow_q[R, BF16_DOT[Cache.dtype, D]](head_q, r, c, qv)


@always_inline
def qk_group[Cache: KVCacheT, R: Int, full: Bool](
    qt: F32Ptr, s: F32Ptr, r0: Int, kp: Ptr[Cache.dtype], vp: Ptr[Cache.dtype], j0: Int, n: Int
):
    """The scores of one block of `group_keys` keys for a head of R = 8 or 4 rows, in
    the form this CPU runs fastest (arguments as `qk_narrow`'s)."""
    comptime if ROW_PAIR_SCORES[Cache.dtype, Cache.kv_params.head_size]:
        qk_row_pairs[Cache, R, full](qt, s, r0, kp, vp, j0, n)
    else:
        qk_narrow[Cache, R, full](qt, s, r0, kp, vp, j0, n)
