"""One work unit of the CPU attention: a pass over its keys that serves all its rows
(`attend_unit`), and the merge of a unit's key splits (`merge_parts`)."""

from std.math import ceildiv
from std.memory import stack_allocation
from std.sys.info import size_of

from ...types import KVCacheT, Ptr, ScalePtr, is_quantized
from ..cpu import W
from ..fp8 import stage_scaled_tile, widened_scale
from ..simd import F32Ptr, exp2
from .forms import BF16_DOT, BF16_PV_DOT, BK, DECODE_O_ORDER, KB, MAX_ROWS, PART_SLOT, RB, STAGED_UNITS
from .pv import o_natural, pv_block
from .scores import qk_block, qk_heads, qk_key_major
from .scores_group import group_keys, qk_group, store_group_q
from .softmax import LOG2E, NO_KEY, softmax_key_major
from .tiles import prefetch_rows, stage_tile


@fieldwise_init
struct Unit(ImplicitlyCopyable, Movable):
    """One task of the CPU path: `ntok` new tokens of batch entry `b` (flat tokens from
    `tok0`, entry-relative from `i0`) x KV heads [h0, h0 + nh), against the keys
    [k_lo, k_hi). With `part` < 0 the unit sees all its keys and writes the output;
    otherwise it is one split of them and leaves its unnormalised softmax state in
    partial slot `part`, and the last split of `merge` to finish runs `merge_parts`."""

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
struct Merge(ImplicitlyCopyable, Movable):
    """A unit whose keys were split: its splits left their states in partial slots
    [unit.part, unit.part + parts)."""

    var unit: Unit
    var parts: Int


@always_inline
def head_rows[staged: Bool](ntok: Int, group: Int) -> Int:
    """Rows one KV head contributes to a unit: ntok x group, padded to a multiple of W
    when there are at least W (prefill's staged scores), else of RB (decode's 4-, 8-
    and 12-row forms); a single row (GQA 1 decode) is not padded. Padding rows get zero
    queries and finite junk, and are never stored. `staged` (`STAGED_UNITS`: a cache
    whose tiles every unit stages as f32): always a multiple of W."""
    var rows = ntok * group
    comptime if staged:
        return ceildiv(rows, W) * W
    if rows == 1:  # one decode token of plain multi-head attention: 1-row blocks
        return 1
    return ceildiv(rows, W) * W if rows >= W else ceildiv(rows, RB) * RB


@always_inline
def _row_offset[staged: Bool](u: Unit, r: Int, group: Int, n_q: Int, D: Int) -> Int:
    """Element offset in q / output of unit row r (rows are KV-head-major, then token,
    then query head of the group). -1 for a padding row."""
    var rows_hp = head_rows[staged](u.ntok, group)
    var rr = r % rows_hp
    if rr >= u.ntok * group:
        return -1
    return ((u.tok0 + rr // group) * n_q + (u.h0 + r // rows_hp) * group + rr % group) * D


@always_inline
def _sink_weight[staged: Bool](sink_log2: F32Ptr, u: Unit, r: Int, group: Int, m: Float32) -> Float32:
    """2^(sink - m): unit row r's head's sink (log2 units) against the row's softmax
    reference m, the term the sink adds to the row's sum (0 for a sink of -inf)."""
    var rows_hp = head_rows[staged](u.ntok, group)
    var head = (u.h0 + r // rows_hp) * group + (r % rows_hp) % group
    return exp2[5](SIMD[DType.float32, W](sink_log2[unsafe_offset=head] - m))[0]


@always_inline
def _o_row[D: Int, dtype: DType](o: F32Ptr, r: Int, c: Int, key_major: Bool) -> SIMD[DType.float32, W]:
    """O[r, c .. c + W] in natural column order: decode units over a `dtype` cache keep
    O in `DECODE_O_ORDER`, prefill (key-major) units in natural order."""
    if key_major:
        return o.unsafe_load[width=W](r * D + c)
    return o_natural[D, DECODE_O_ORDER[dtype, D]](o, r, c)


@always_inline
def _v_scales_by_row[SSTRIDE: Int](ps: F32Ptr, scales: ScalePtr, nh: Int, rows_hp: Int, n: Int):
    """ps[j, r] = key j's V scale (`widened_scale`) for every row r of the unit's nh heads
    of rows_hp rows (one scale per head): the factors `softmax_key_major` rounds into
    P for `dot_bf16` P V over an FP8 cache. (Decode units stage no tile: ps is that
    buffer, BK x MAX_ROWS floats of its BK x D.)"""
    for j in range(n):
        for hh in range(nh):
            var sc = widened_scale[SSTRIDE](scales.unsafe_offset(hh), j)
            var row = ps.unsafe_offset(j * MAX_ROWS + hh * rows_hp)
            if rows_hp % 4 == 0:
                for r in range(0, rows_hp, 4):
                    row.unsafe_store(r, SIMD[DType.float32, 4](sc))
            else:
                for r in range(rows_hp):
                    row.unsafe_store(r, sc)


def attend_unit[Cache: KVCacheT, q_dtype: DType](
    kc: Cache,
    vc: Cache,
    q: Ptr[q_dtype],  # [total_tokens, n_q, D]
    output: Ptr[q_dtype],  # [total_tokens, n_q, D]
    u: Unit,
    group: Int,
    n_q: Int,
    scale: Float32,
    window: Int,  # keys a query reads, itself included (a sliding window); 0: all before it
    sink_log2: F32Ptr,  # [n_q]: each query head's sink logit in log2 units (-inf: none)
    parts: F32Ptr,  # partial slots, PART_SLOT[D] floats each
):
    """Online-softmax attention of one unit: all its rows share one pass over its keys.
    With a window, a row at position p reads [p - window + 1, p] and the unit's keys
    start at its first row's window (`plan_units`); the tiles before a later row's
    window are masked for it.

    Each key tile takes three steps: the scores S^T [keys, rows] (prefill units, with
    at least W rows per head, from f32-staged tiles; decode units from K as stored, in
    the form that fits their rows per head), one lane-wise online-softmax step, and
    O += P V head by head. Decode units walk several heads per key tile.

    An FP8 cache's key-major units stage each K and V tile as f32, dequantized
    (`stage_scaled_tile`); its decode units read the bytes in the decode forms, which
    widen them unscaled (to bf16 for `dot_bf16`, else f32) and fold each key's scale
    into its scores and probabilities (one scale per head). With heads of several scale blocks (`STAGED_UNITS`) every
    unit is key-major.
    """
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    comptime assert D % W == 0, "head_size must be a multiple of 16 on CPU"
    comptime DOT = BF16_DOT[Cache.dtype, D]
    comptime SSTRIDE = Cache.scale_stride()
    comptime FP8 = is_quantized[Cache.dtype]()
    comptime NB = SSTRIDE // Cache.kv_params.num_heads  # scales per head
    comptime STAGED = STAGED_UNITS[Cache.dtype, D]
    var rows_hp = head_rows[STAGED](u.ntok, group)
    var rows_p = u.nh * rows_hp
    # Scores of a GQA 8 or 4 head from K as stored (`qk_group`). Not over FP8 bytes:
    # `qk_narrow` widens each key's group of 1-2 bytes for one FMA, `qk_block` a vector
    # of W bytes for 4 rows' FMAs (or dot products).
    comptime GROUP_FORMS = not FP8
    var narrow = GROUP_FORMS and (rows_hp == 8 or rows_hp == 4)
    # Staged, key-major scores for whole vectors of rows; a head of 8 rows is a decode
    # head for `qk_group` even where 8 rows fill a vector (the portable paths' W = 8).
    var key_major = STAGED or (rows_hp % W == 0 and not narrow)
    var paired = BF16_PV_DOT[Cache.dtype, D] and not key_major  # P V with `dot_bf16`: O's columns in paired order
    var qs = stack_allocation[MAX_ROWS * D, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var o = stack_allocation[MAX_ROWS * D, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var s = stack_allocation[MAX_ROWS * BK, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var kf = stack_allocation[BK * D, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()  # a staged K or V tile
    var pb = stack_allocation[MAX_ROWS * BK // 2, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()  # bf16 P pairs
    var m = stack_allocation[MAX_ROWS, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var l = stack_allocation[MAX_ROWS, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var last = stack_allocation[MAX_ROWS, Int32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var first = stack_allocation[MAX_ROWS, Int32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var first_pos = kc.cache_length(u.b) + u.i0  # position of the unit's first token
    var scale_log2 = scale * LOG2E  # scores in log2 units: the softmax takes powers of 2
    for r in range(rows_p):
        var off = _row_offset[STAGED](u, r, group, n_q, D)
        comptime for c in range(0, D, W):
            var qv = SIMD[DType.float32, W](0)
            if off >= 0:
                qv = q.unsafe_load[width=W](off + c).cast[DType.float32]() * scale_log2
            if key_major:  # qs is Q^T [D, MAX_ROWS]
                comptime for i in range(W):
                    qs.unsafe_store((c + i) * MAX_ROWS + r, qv[i])
            elif narrow:  # per head, in `qk_group`'s lane order
                comptime if GROUP_FORMS:
                    var head_q = qs.unsafe_offset((r // rows_hp) * rows_hp * D)
                    if rows_hp == 8:
                        store_group_q[Cache, 8](head_q, r, c, qv)
                    else:
                        store_group_q[Cache, 4](head_q, r, c, qv)
            else:  # qs is Q [rows, D], in bf16 for `dot_bf16` scores
                comptime if DOT:
                    qs.unsafe_bitcast[BFloat16]().unsafe_store(r * D + c, qv.cast[DType.bfloat16]())
                else:
                    qs.unsafe_store(r * D + c, qv)
            o.unsafe_store(r * D + c, SIMD[DType.float32, W](0))
        m.unsafe_store(r, NO_KEY)
        l.unsafe_store(r, 0)
        var pos = first_pos + (r % rows_hp) // group
        last.unsafe_store(r, Int32(pos))
        first.unsafe_store(r, Int32(pos - window + 1 if window else 0))
    # The key-major softmax takes W rows at a time: give padding rows a finite state.
    for r in range(rows_p, ceildiv(rows_p, W) * W):
        comptime for c in range(0, D, W):
            o.unsafe_store(r * D + c, SIMD[DType.float32, W](0))
        m.unsafe_store(r, NO_KEY)
        l.unsafe_store(r, 0)
        last.unsafe_store(r, Int32(first_pos))
        first.unsafe_store(r, 0)
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
    # Every row's window starts at or before this key (the last row's window start; 0
    # without a window): a tile that starts before it is masked.
    var all_see = first_pos + u.ntok - window if window else 0
    prefetch_rows[Cache](kc.row_ptr(u.b, u.h0, k_tok), min(tile_keys, kc.contiguous_tokens(k_tok), kv_end - k_tok), width)
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
        # The diagonal tile (some keys in some row's future), or a tile before some row's window.
        var masked = k_tok + n - 1 > first_pos or k_tok < all_see
        # An FP8 cache's scales of the unit's first head at the tile's first key (the
        # score buffer stands in for other caches: never read).
        var ksp = s
        var vsp = s
        comptime if FP8:
            ksp = kc.scale_ptr(u.b, u.h0, k_tok)
            vsp = vc.scale_ptr(u.b, u.h0, k_tok)
        if key_major:
            for hh in range(u.nh):
                prefetch_rows[Cache](vp.unsafe_offset(hh * D), n, D)
                comptime if FP8:
                    stage_scaled_tile[Cache](kf, kp.unsafe_offset(hh * D), ksp.unsafe_offset(hh * NB), n)
                else:
                    stage_tile[Cache](kf, kp.unsafe_offset(hh * D), n)
                var r = hh * rows_hp
                var r_end = r + rows_hp
                while r < r_end:
                    if r_end - r >= 4 * W:
                        qk_key_major[D, 4](qs, kf, s, r, n)
                        r += 4 * W
                    elif r_end - r >= 2 * W:
                        qk_key_major[D, 2](qs, kf, s, r, n)
                        r += 2 * W
                    else:
                        qk_key_major[D, 1](qs, kf, s, r, n)
                        r += W
        else:
            comptime if not STAGED:  # (every unit is key-major)
                if narrow:
                    # Key blocks outer, heads inner: the tile is read in address order (a
                    # token's heads are adjacent), which the hardware prefetchers follow.
                    comptime if GROUP_FORMS:
                        comptime NK = group_keys[Cache]()
                        for j0 in range(0, n, NK):
                            for hh in range(u.nh):
                                var qh = qs.unsafe_offset(hh * rows_hp * D)
                                var r0 = hh * rows_hp
                                var kh = kp.unsafe_offset(hh * D)
                                var vh = vp.unsafe_offset(hh * D)
                                if j0 + NK > n:
                                    prefetch_rows[Cache](vh.unsafe_offset(j0 * STRIDE), n - j0, D)
                                    if rows_hp == 8:
                                        qk_group[Cache, 8, False](qh, s, r0, kh, vh, j0, n)
                                    else:
                                        qk_group[Cache, 4, False](qh, s, r0, kh, vh, j0, n)
                                elif rows_hp == 8:
                                    qk_group[Cache, 8, True](qh, s, r0, kh, vh, j0, n)
                                else:
                                    qk_group[Cache, 4, True](qh, s, r0, kh, vh, j0, n)
                elif rows_hp == 1:  # GQA 1 decode: key by key, W heads at a time, in address order
                    for j in range(n):
                        for h0 in range(0, u.nh, W):
                            qk_heads[Cache](qs, s, h0, u.nh, kp, vp, ksp, j)
                else:  # key blocks outer, heads inner, as above
                    for j0 in range(0, n, KB):
                        for hh in range(u.nh):
                            prefetch_rows[Cache](vp.unsafe_offset(j0 * STRIDE + hh * D), min(KB, n - j0), D)
                            for r0 in range(hh * rows_hp, (hh + 1) * rows_hp, RB):
                                qk_block[Cache](qs, s, r0, kp.unsafe_offset(hh * D), ksp.unsafe_offset(hh * NB), j0, n)
        if paired:
            comptime if FP8:  # P rounded to bf16 times each key's V scale: kf holds them by row
                _v_scales_by_row[SSTRIDE](kf, vsp, u.nh, rows_hp, n)
            softmax_key_major[D, True, FP8](s, m, l, o, last, first, rows_p, n, k_tok, masked, pb, kf)
        else:
            softmax_key_major[D, False](s, m, l, o, last, first, rows_p, n, k_tok, masked, pb, kf)

        if key_major:
            for hh in range(u.nh):
                prefetch_rows[Cache](kp_next.unsafe_offset(hh * D), n_next, D)
                comptime if FP8:
                    stage_scaled_tile[Cache](kf, vp.unsafe_offset(hh * D), vsp.unsafe_offset(hh * NB), n)
                else:
                    stage_tile[Cache](kf, vp.unsafe_offset(hh * D), n)
                for r0 in range(hh * rows_hp, (hh + 1) * rows_hp, RB):
                    pv_block[DType.float32, D, D](o, s, r0, kf, vsp, n, kf, 0)
        else:
            comptime if not STAGED:
                var p = pb if paired else s
                for hh in range(u.nh):
                    var vh = vp.unsafe_offset(hh * D)
                    var kh = kp_next.unsafe_offset(hh * D)
                    var vsh = vsp.unsafe_offset(hh * NB)
                    if rows_hp == 8:
                        pv_block[Cache.dtype, D, STRIDE, 8, SSTRIDE](o, p, hh * 8, vh, vsh, n, kh, n_next)
                    elif rows_hp == 1:
                        pv_block[Cache.dtype, D, STRIDE, 1, SSTRIDE](o, p, hh, vh, vsh, n, kh, n_next)
                    else:
                        for r0 in range(hh * rows_hp, (hh + 1) * rows_hp, RB):
                            pv_block[Cache.dtype, D, STRIDE, RB, SSTRIDE](
                                o, p, r0, vh, vsh, n, kh, n_next if r0 == hh * rows_hp else 0
                            )
        k_tok += n

    if u.part >= 0:  # one split of the keys: keep the raw state for the merge
        var slot = parts.unsafe_offset(u.part * PART_SLOT[D])
        for r in range(rows_p):
            comptime for c in range(0, D, W):
                slot.unsafe_store(r * D + c, _o_row[D, Cache.dtype](o, r, c, key_major))
            slot.unsafe_store(MAX_ROWS * D + r, m.unsafe_load(r))
            slot.unsafe_store(MAX_ROWS * (D + 1) + r, l.unsafe_load(r))
        return
    for r in range(rows_p):
        var off = _row_offset[STAGED](u, r, group, n_q, D)
        if off < 0:
            continue
        var sink = _sink_weight[STAGED](sink_log2, u, r, group, m.unsafe_load(r))
        var inv = 1 / (l.unsafe_load(r) + sink)
        comptime for c in range(0, D, W):
            output.unsafe_store(off + c, (_o_row[D, Cache.dtype](o, r, c, key_major) * inv).cast[q_dtype]())


def merge_parts[q_dtype: DType, D: Int, staged: Bool](
    mg: Merge, parts: F32Ptr, output: Ptr[q_dtype], group: Int, n_q: Int, sink_log2: F32Ptr
):
    """Combines the softmax states of a unit's key splits: with M the largest running
    max, out = sum_s e^(m_s - M) o_s / (sum_s e^(m_s - M) l_s + e^(sink - M))."""
    var u = mg.unit
    for r in range(u.nh * head_rows[staged](u.ntok, group)):
        var off = _row_offset[staged](u, r, group, n_q, D)
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
        l += _sink_weight[staged](sink_log2, u, r, group, mx)
        comptime for c in range(D // W):
            output.unsafe_store(off + c * W, (acc[c] / l).cast[q_dtype]())
