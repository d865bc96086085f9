"""Causal GQA attention over the KV cache on a GPU: flash-decoding, one warp per work unit.

A work unit is (new token, block of GB query heads of one GQA group, split of the
keys). Its warp walks the split's keys once: every K and V row it loads serves all GB
heads, so each K/V byte is read once per GQA group (per GB heads when a group has
more than 8), not once per query head.

Inside a warp, L = `lanes_per_key[D]` lanes share one key row, E = D / L elements each
(8 for the common head sizes: one 16-byte load per bf16 row slice), so a warp holds
32 / L keys at once and each load instruction reads whole 128-byte lines. A lane keeps
GB queries' slices and GB online-softmax states (m, l, o[E]) in registers; a score is
one FMA chain of E products plus a butterfly over the L lanes of its key. The unroll
U = 2 loads two keys per lane slot before their first use. Scores are kept in base 2
(log2(e) folded into the scale) so each exponential is one `ex2`.

Long contexts are split across units (flash-decoding) until there are about
TARGET_UNITS units, each split MIN_SPLIT_KEYS..MAX_SPLIT_KEYS keys; `merge_splits`
then combines the splits' (m, l, o) states. The split count comes from the cache's
`max_positions()`, a capacity known on the host; the last split always runs to the
token's position, so the count only shapes the parallelism, never the result.

Measured on an H200 (bf16, 32 query heads, head 128, batch 32 x 4k and 8 x 16k keys;
share of a device-to-device copy's bytes read + written per second, 4.27 TB/s):
decode is a stream over HBM, and the warps resident per SM decide how many bytes are
in flight. TARGET_UNITS 8192 instead of 2048 took GQA 1 from 50-53% to 74-77%; GQA 4
(~50%) and GQA 8 (~25%) did not move: most likely bound by the per-key instructions of
their 4 or 8 heads (the shuffles and FMAs above; not checked with counters). U = 4 and L = 32 (4
elements per lane) were slower everywhere (GQA 1: 48% and 26-41%); capping GB at 4 for
GQA 8 changed nothing, and GB = 2 for GQA 4 halved it. MAX 26.7's decode kernel read
at 85-99% in the same run. Those numbers predate `_slice_align`: until then every
slice load claimed only the element's alignment, and the SASS (nvdisasm of the
cubins in MAX's cache after a virtual sm_90 build) showed eight `LDG.E.U16` per 16-byte
bf16 slice, 64 loads per GQA 4 step where there are now 8 `LDG.E.128`; not yet timed.

Prefill tokens use the same units (each new token's row walks its own keys, ~12
TFLOP/s at 2k tokens against MAX's tensor-core 350); a tiled prefill is future work.
"""

from std.math import ceildiv, exp2
from std.sys import size_of

from max.gpu import block_idx, thread_idx
from max.gpu.host import DeviceContext
from max.gpu.primitives.warp import shuffle_xor

from ...types import KVCacheT, Ptr, U32Ptr
from ..ragged import batch_of_token

comptime WARP = 32
comptime MIN_SPLIT_KEYS = 256
comptime MAX_SPLIT_KEYS = 2048
comptime TARGET_UNITS = 8192  # ~62 one-warp units per SM of an H100/H200 (132 SMs): see the module docstring
comptime U = 2  # keys per lane slot in flight: see the module docstring
comptime LOG2E: Float32 = 1.4426950408889634


def lanes_per_key[D: Int]() -> Int:
    """Lanes sharing one key row: the most (up to a warp) that leave each lane >= 8
    elements, so a lane's slice of a bf16 row is at least one 16-byte load."""
    var lanes = WARP
    while lanes > 1 and (D % lanes != 0 or D // lanes < 8):
        lanes //= 2
    return lanes


def heads_per_unit(group: Int) -> Int:
    """Query heads a unit serves: the largest of 8, 4, 2, 1 dividing the GQA group
    (registers hold GB queries and GB output slices per lane)."""
    var gb = 8
    while group % gb != 0:
        gb //= 2
    return gb


def _slice_align[dtype: DType, E: Int]() -> Int:
    """Byte alignment of an E-element slice (E a power of two), capped at one 16-byte
    access. Every slice starts a multiple of its own size into a row of D elements,
    and rows start on multiples of D elements, so the claim holds. Without it a load
    takes the element's alignment and a 16-byte bf16 slice becomes eight 2-byte loads
    (seen in the SASS)."""
    return min(16, E * size_of[dtype]())


@always_inline
def _load_slice[dtype: DType, E: Int](p: Ptr[dtype]) -> SIMD[DType.float32, E]:
    comptime if E & (E - 1) == 0:
        return p.unsafe_load[width=E, alignment=_slice_align[dtype, E]()](0).cast[DType.float32]()
    else:
        var out = SIMD[DType.float32, E]()
        comptime for e in range(E):
            out[e] = p.unsafe_load(e).cast[DType.float32]()
        return out


@always_inline
def _store_slice[dtype: DType, E: Int](p: Ptr[dtype], x: SIMD[DType.float32, E]):
    comptime if E & (E - 1) == 0:
        p.unsafe_store[alignment=_slice_align[dtype, E]()](0, x.cast[dtype]())
    else:
        comptime for e in range(E):
            p.unsafe_store(e, x[e].cast[dtype]())


def _log2(n: Int) -> Int:
    var k = 0
    while (1 << (k + 1)) <= n:
        k += 1
    return k


@always_inline
def _lane_sum[L: Int](x: Float32) -> Float32:
    """Sum over the L lanes of one key (aligned groups of L lanes), in every lane."""
    var s = x
    comptime for i in range(_log2(L)):
        s += shuffle_xor(s, UInt32(L >> (i + 1)))
    return s


@always_inline
def _dot[E: Int](a: SIMD[DType.float32, E], b: SIMD[DType.float32, E]) -> Float32:
    """One FMA chain (a reduce_add of the product costs E - 1 extra adds)."""
    var s = a[0] * b[0]
    comptime for e in range(1, E):
        s = a[e].fma(b[e], s)
    return s


def split_plan(rows: Int, max_positions: Int, step: Int) -> Tuple[Int, Int]:
    """(splits, keys per split): about TARGET_UNITS units if every sequence were at
    `max_positions`, each split MIN_SPLIT_KEYS..MAX_SPLIT_KEYS keys (a multiple of
    `step`). The cap matters when the bound is a capacity (a continuous slot): a 4k
    context in a 16k slot still gets two splits instead of sitting in one."""
    var keys = ceildiv(max_positions * rows, TARGET_UNITS)
    keys = min(max(keys, MIN_SPLIT_KEYS), MAX_SPLIT_KEYS)
    keys = ceildiv(keys, step) * step
    return (max(1, ceildiv(max_positions, keys)), keys)


@always_inline
def split_keys_of[Cache: KVCacheT](
    kc: Cache, offsets: U32Ptr, batch_size: Int, tok: Int, split: Int, splits: Int, split_keys: Int
) -> Tuple[Int, Int, Int]:
    """(batch entry, first key, end key) of split `split` of new token `tok`'s keys
    (flat token index): the last split runs to the token's own position."""
    var b = batch_of_token(offsets, batch_size, tok)
    var n_keys = kc.cache_length(b) + tok - Int(offsets[unsafe_offset=b]) + 1
    var k0 = split * split_keys
    var k1 = n_keys if split == splits - 1 else min(n_keys, k0 + split_keys)
    return (b, k0, k1)


def gpu_attention[Cache: KVCacheT, q_dtype: DType, GB: Int](
    kc: Cache,
    vc: Cache,
    output: Ptr[q_dtype],  # [total_tokens, n_q, D]
    q: Ptr[q_dtype],  # [total_tokens, n_q, D]
    offsets: U32Ptr,  # [batch_size + 1], on the device
    total_tokens: Int,
    n_q: Int,
    group: Int,
    scale: Float32,
    ctx: DeviceContext,
) raises:
    """Enqueues the units (and the merge when keys are split) for GB heads per unit."""
    comptime D = Cache.kv_params.head_size
    comptime L = lanes_per_key[D]()
    comptime E = D // L
    comptime SLOTS = WARP // L  # keys a warp holds at once
    comptime STEP = SLOTS * U  # keys per loop iteration
    var batch_size = kc.batch_size()
    var max_positions = kc.max_positions()
    var head_blocks = n_q // GB
    var rows = total_tokens * head_blocks
    if rows == 0:
        return
    var splits, split_keys = split_plan(rows, max_positions, STEP)
    var qscale = scale * LOG2E
    # Split partial states: o [rows * GB * splits, D], then (m, l) pairs.
    var parts = ctx.enqueue_create_buffer[DType.float32](max(1, rows * GB * splits * (D + 2)) if splits > 1 else 1)
    var part_ptr = parts.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

    def unit() {var kc, var vc, var q, var output, var offsets, var batch_size, var n_q, var group, var head_blocks, var rows, var splits, var split_keys, var qscale, var part_ptr}:
        var row = Int(block_idx.x)
        var split = Int(block_idx.y)
        var lane = Int(thread_idx.x)
        var tok = row // head_blocks
        var qh0 = (row % head_blocks) * GB
        var h = qh0 // group
        var b, k0, k1 = split_keys_of(kc, offsets, batch_size, tok, split, splits, split_keys)
        var slot = lane // L
        var e0 = (lane % L) * E

        var qv = Array[SIMD[DType.float32, E], GB](fill=0)
        var o = Array[SIMD[DType.float32, E], GB](fill=0)
        var m = Array[Float32, GB](fill=Float32.MIN)
        var l = Array[Float32, GB](fill=0)
        comptime for g in range(GB):
            qv[g] = _load_slice[q_dtype, E](q.unsafe_offset((tok * n_q + qh0 + g) * D + e0)) * qscale

        var key = k0 + slot
        while key - slot < k1:
            # Load U keys' slices first (clamped to the last key: masked below), then use them.
            var ks = Array[SIMD[DType.float32, E], U](fill=0)
            var vs = Array[SIMD[DType.float32, E], U](fill=0)
            comptime for u in range(U):
                var kk = min(key + u * SLOTS, k1 - 1)
                ks[u] = _load_slice[Cache.dtype, E](kc.row_ptr(b, h, kk).unsafe_offset(e0))
                vs[u] = _load_slice[Cache.dtype, E](vc.row_ptr(b, h, kk).unsafe_offset(e0))
            comptime for g in range(GB):
                var s = Array[Float32, U](fill=0)
                var mx = m[g]
                comptime for u in range(U):
                    s[u] = _lane_sum[L](_dot(qv[g], ks[u]))
                    if key + u * SLOTS >= k1:
                        s[u] = Float32.MIN
                    mx = max(mx, s[u])
                # A slot with no key yet keeps mx = -inf: 0 as the base keeps every
                # exponent at -inf (weights 0) instead of -inf - -inf (NaN).
                var base = mx if mx > Float32.MIN else Float32(0)
                var alpha = exp2(m[g] - base)
                var acc = o[g] * alpha
                var lsum = l[g] * alpha
                comptime for u in range(U):
                    var p = exp2(s[u] - base)
                    lsum += p
                    acc += vs[u] * p
                o[g] = acc
                l[g] = lsum
                m[g] = mx
            key += STEP

        # Combine the warp's key slots (lanes L, 2L, ... apart hold the same dims).
        comptime for i in range(_log2(SLOTS)):
            comptime off = L << i
            comptime for g in range(GB):
                var m_o = shuffle_xor(m[g], UInt32(off))
                var l_o = shuffle_xor(l[g], UInt32(off))
                var mx = max(m[g], m_o)
                var a = exp2(m[g] - mx) if l[g] > 0 else Float32(0)
                var a_o = exp2(m_o - mx) if l_o > 0 else Float32(0)
                var o_o = SIMD[DType.float32, E]()
                comptime for e in range(E):
                    o_o[e] = shuffle_xor(o[g][e], UInt32(off))
                o[g] = o[g] * a + o_o * a_o
                l[g] = l[g] * a + l_o * a_o
                m[g] = mx
        if slot != 0:
            return
        comptime for g in range(GB):
            var qh = qh0 + g
            if splits == 1:
                _store_slice[q_dtype, E](output.unsafe_offset((tok * n_q + qh) * D + e0), o[g] / l[g])
            else:
                var part = (tok * n_q + qh) * splits + split
                _store_slice[DType.float32, E](part_ptr.unsafe_offset(part * D + e0), o[g])
                if lane == 0:
                    var ml = part_ptr.unsafe_offset(rows * GB * splits * D + 2 * part)
                    ml.unsafe_store(0, m[g])
                    ml.unsafe_store(1, l[g])

    ctx.enqueue_function(unit, grid_dim=(rows, splits), block_dim=WARP)
    if splits > 1:
        merge_splits[q_dtype, D](output, part_ptr, total_tokens * n_q, splits, ctx)
    _ = parts^  # freed in stream order, after the kernels that read it


def merge_splits[q_dtype: DType, D: Int](
    output: Ptr[q_dtype],
    parts: Pointer[Float32, MutUntrackedOrigin],  # o [n_rows * splits, D], then (m, l) pairs
    n_rows: Int,  # total_tokens * n_q
    splits: Int,
    ctx: DeviceContext,
) raises:
    """Writes out[row] = sum_s o_s 2^(m_s - M) / sum_s l_s 2^(m_s - M), M = max_s m_s; splits
    that saw no key (l = 0) count for nothing. One block per (token, query head)."""

    var rows64 = Int64(n_rows)  # captures must be fixed-width to pass to the device
    var splits64 = Int64(splits)

    def merge() {var output, var parts, var rows64, var splits64}:
        var n_rows = Int(rows64)
        var splits = Int(splits64)
        var row = Int(block_idx.x)
        var d = Int(thread_idx.x)
        var ml = parts.unsafe_offset(n_rows * splits * D + 2 * row * splits)
        var mx = Float32.MIN
        for s in range(splits):
            if ml.unsafe_load(2 * s + 1) > 0:
                mx = max(mx, ml.unsafe_load(2 * s))
        var num: Float32 = 0
        var den: Float32 = 0
        for s in range(splits):
            var ls = ml.unsafe_load(2 * s + 1)
            if ls > 0:
                var w = exp2(ml.unsafe_load(2 * s) - mx)
                num += parts.unsafe_load((row * splits + s) * D + d) * w
                den += ls * w
        output.unsafe_store(row * D + d, (num / den).cast[q_dtype]())

    ctx.enqueue_function(merge, grid_dim=n_rows, block_dim=D)
