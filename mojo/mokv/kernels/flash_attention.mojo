"""Causal, grouped-query flash attention over a ragged batch and a KV cache layer.

    q   [total_tokens, n_q, D]   new tokens' queries (row offsets per batch entry)
    out [total_tokens, n_q, D]

New token `i` of entry `b` sits at position `p = cache_lengths[b] + i` and sees cache
positions [0, p]. The K/V of the new tokens must already be in the cache (store_kv or
fused_qkv_matmul ran first). Softmax is the online (flash) form in float32.

CPU design (decode is memory-bound, prefill compute-bound):
  * A work unit is (batch entry, KV head, tile of TQ new tokens). Its rows are every
    query head of the GQA group for those tokens: R = TQ * group <= 64 rows. One pass
    over the unit's keys serves all R rows, so in decode each K/V byte is read ONCE per
    GQA group (MAX 26.7's CPU kernel re-reads it per query head), and in prefill a K/V
    tile loaded into L1 serves 64 rows.
  * Keys are walked in tiles of at most TK tokens (16 KiB of K) that never cross a page
    end (`contiguous_tokens`), so a tile is rows at one constant stride. The V rows of a
    tile and the K rows of the next are prefetched in software: rows of one head are a
    whole token apart, so each row sits on its own 4 KiB page and the hardware stream
    prefetchers never run ahead.
  * S = Q K^T: a 4-row x 4-key register block is 16 independent FMA chains over D,
    reduced by one 15-shuffle butterfly (no horizontal `reduce_add` per score).
    P V: a 4-row x 64-column block, 16 accumulators; each V chunk is widened to f32 once
    per block (bf16 by a bit shift). Rows are padded to a multiple of 4.
  * Causality: the key loop stops at the tile's last visible position, so tiles the
    mask hides entirely are never read; only the diagonal tile applies a mask.
  * Units run in parallel with `sync_parallelize`.
GPU: one thread per (token, query head), a plain online-softmax loop (correct, simple).
"""

from std.math import ceildiv, exp
from std.memory import stack_allocation
from std.utils.index import IndexList
from std.sys.info import size_of
from std.sys.intrinsics import prefetch, PrefetchOptions

from max.algorithm import sync_parallelize
from max.gpu import block_dim, block_idx, thread_idx
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu

from ..types import KVCacheT, KVCollectionT, Ptr, U32Ptr
from .ragged import batch_of_token

comptime F32Ptr = Pointer[Float32, MutUntrackedOrigin]
comptime W = 16  # f32 lanes of one AVX-512 register
comptime BK = 64  # most keys per tile (the row stride of the score tile)
comptime MAX_ROWS = 64  # query rows (tokens x group heads) per unit: K/V tiles are loaded once per unit
comptime RB = 4  # rows per register block (rows are padded to a multiple of RB)
comptime KB = W // RB  # keys per QK register block: RB * KB = 16 accumulators


@always_inline
def _widen[dtype: DType](p: Ptr[dtype], off: Int) -> SIMD[DType.float32, W]:
    """Loads W elements as f32. bf16 widens by a 16-bit shift of the bits (exact, and
    much cheaper than the generic conversion LLVM emits for `cast`)."""
    comptime if dtype == DType.bfloat16:
        var bits = p.unsafe_bitcast[UInt16]().unsafe_load[width=W](off).cast[DType.uint32]() << 16
        return SIMD[DType.float32, W](from_bits=bits)
    else:
        return p.unsafe_load[width=W](off).cast[DType.float32]()


@always_inline
def _prefetch_rows[Cache: KVCacheT](p: Ptr[Cache.dtype], n: Int):
    """Prefetches n K or V rows. Rows of one head sit a whole token (all heads) apart,
    4 KiB for 8 f32 heads of 128, so each row is on its own page and the hardware
    stream prefetchers (which stop at page ends) never run ahead. (A plain strided
    read of that pattern went from 21 to 23 GB/s on one thread with it; in the kernel
    the gain was within the noise of a loaded 2-core box.)"""
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    comptime LINE_ELEMS = 64 // size_of[Scalar[Cache.dtype]]()
    for j in range(n):
        comptime for c in range(0, D, LINE_ELEMS):
            prefetch[PrefetchOptions().for_read().high_locality()](p.unsafe_offset(j * STRIDE + c))


def _fold_mask[s: Int, hi: Int]() -> IndexList[W]:
    """Lanes of concat(x, y) that one butterfly level adds: x and y each hold W // s
    partial sums of s lanes; the result holds all 2W // s of them, s // 2 lanes each."""
    var m = IndexList[W]()
    comptime half = s // 2
    for o in range(W):
        var k = o // half
        var src = k * s if k < W // s else W + (k - W // s) * s
        m[o] = src + o % half + hi * half
    return m


@always_inline
def _fold[s: Int](x: SIMD[DType.float32, W], y: SIMD[DType.float32, W]) -> SIMD[DType.float32, W]:
    comptime lo = _fold_mask[s, 0]()
    comptime hi = _fold_mask[s, 1]()
    return x.shuffle[lo](y) + x.shuffle[hi](y)


@always_inline
def _reduce_16(acc: Array[SIMD[DType.float32, W], W]) -> SIMD[DType.float32, W]:
    """Lane i of the result = acc[i].reduce_add(). A butterfly of 15 two-source shuffles
    pairs and adds, about 3 instructions per sum instead of 8 for a `reduce_add` each."""
    var b = Array[SIMD[DType.float32, W], 8](fill=0)
    comptime for i in range(8):
        b[i] = _fold[16](acc[2 * i], acc[2 * i + 1])
    var c = Array[SIMD[DType.float32, W], 4](fill=0)
    comptime for i in range(4):
        c[i] = _fold[8](b[2 * i], b[2 * i + 1])
    return _fold[2](_fold[4](c[0], c[1]), _fold[4](c[2], c[3]))


@always_inline
def _qk_block[Cache: KVCacheT](
    qs: F32Ptr,  # [rows, D] scaled queries (f32), rows a multiple of RB
    s: F32Ptr,  # [rows, BK] scores of this tile
    r0: Int,
    kp: Ptr[Cache.dtype],  # first key row of the tile
    j0: Int,
    n: Int,
):
    """S[r0 .. r0+RB, j0 .. j0+KB] = Q K^T for RB rows x KB keys at once.

    The RB*KB = 16 dot products are 16 independent FMA chains (one key at a time left
    4 chains, bound by FMA latency), and one butterfly reduces all 16 at once. Keys
    past n repeat key n-1 (never read past the page); their scores land in unused slots.
    """
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    var koff = Array[Int, KB](fill=0)
    comptime for kk in range(KB):
        koff[kk] = min(j0 + kk, n - 1) * STRIDE
    var acc = Array[SIMD[DType.float32, W], W](fill=0)  # [rr * KB + kk]
    comptime for c in range(0, D, W):
        var kv = Array[SIMD[DType.float32, W], KB](fill=0)
        comptime for kk in range(KB):
            kv[kk] = _widen(kp, koff[kk] + c)
        comptime for rr in range(RB):
            var qv = qs.unsafe_load[width=W]((r0 + rr) * D + c)
            comptime for kk in range(KB):
                acc[rr * KB + kk] = qv.fma(kv[kk], acc[rr * KB + kk])
    var sc = _reduce_16(acc)
    comptime for rr in range(RB):
        s.unsafe_store((r0 + rr) * BK + j0, sc.slice[KB, offset=rr * KB]())


@always_inline
def _pv_block[Cache: KVCacheT](
    o: F32Ptr,  # [rows, D] output accumulators
    p: F32Ptr,  # [rows, BK] probabilities of this tile
    r0: Int,
    vp: Ptr[Cache.dtype],  # first value row of the tile
    n: Int,
):
    """O[r0 .. r0+RB] += P[r0 .. r0+RB, :n] . V[:n], NC 16-lane column chunks per pass:
    RB*NC = 16 accumulators, and each loaded V chunk / broadcast p serves NC / RB FMAs."""
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    comptime NC = 4 if D % (4 * W) == 0 else (2 if D % (2 * W) == 0 else 1)
    comptime for c0 in range(0, D, NC * W):
        var acc = Array[SIMD[DType.float32, W], RB * NC](fill=0)
        for j in range(n):
            var vv = Array[SIMD[DType.float32, W], NC](fill=0)
            comptime for cc in range(NC):
                vv[cc] = _widen(vp, j * STRIDE + c0 + cc * W)
            comptime for rr in range(RB):
                var pj = SIMD[DType.float32, W](p.unsafe_load((r0 + rr) * BK + j))
                comptime for cc in range(NC):
                    acc[rr * NC + cc] = pj.fma(vv[cc], acc[rr * NC + cc])
        comptime for rr in range(RB):
            comptime for cc in range(NC):
                var off = (r0 + rr) * D + c0 + cc * W
                o.unsafe_store(off, o.unsafe_load[width=W](off) + acc[rr * NC + cc])


def _attend_unit[Cache: KVCacheT, q_dtype: DType](
    kc: Cache,
    vc: Cache,
    q: Ptr[q_dtype],  # [total_tokens, n_q, D]
    output: Ptr[q_dtype],  # [total_tokens, n_q, D]
    b: Int,
    h: Int,  # KV head
    tok0: Int,  # first flat token of the tile
    i0: Int,  # its index among entry b's new tokens
    ntok: Int,
    group: Int,
    n_q: Int,
    scale: Float32,
):
    """Attention for `ntok` tokens x `group` query heads of KV head `h` of entry `b`."""
    comptime D = Cache.kv_params.head_size
    comptime assert D % W == 0, "head_size must be a multiple of 16 on CPU"
    var rows = ntok * group  # row r <-> (token tok0 + r // group, query head h * group + r % group)
    var rows_p = ceildiv(rows, RB) * RB  # padding rows: zero queries, finite junk, never stored
    var qs = stack_allocation[MAX_ROWS * D, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var o = stack_allocation[MAX_ROWS * D, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var s = stack_allocation[MAX_ROWS * BK, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var m = stack_allocation[MAX_ROWS, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var l = stack_allocation[MAX_ROWS, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    for r in range(rows_p):
        var src = q.unsafe_offset(((tok0 + r // group) * n_q + h * group + r % group) * D)
        comptime for c in range(0, D, W):
            var qv = SIMD[DType.float32, W](0)
            if r < rows:
                qv = src.unsafe_load[width=W](c).cast[DType.float32]() * scale
            qs.unsafe_store(r * D + c, qv)
            o.unsafe_store(r * D + c, SIMD[DType.float32, W](0))
        m.unsafe_store(r, Float32.MIN)
        l.unsafe_store(r, 0)

    # Keys per tile: a K tile of at most 16 KiB stays in L1 (with the row block's
    # queries) while every row block of the unit walks it; the f32 tile is half as long.
    comptime TK = max(KB, min(BK, 16384 // (D * size_of[Scalar[Cache.dtype]]())))
    var first_pos = kc.cache_length(b) + i0  # position of the tile's first token
    var kv_end = first_pos + ntok  # keys [0, kv_end) are visible to some row
    var k_tok = 0
    _prefetch_rows[Cache](kc.row_ptr(b, h, 0), min(TK, kc.contiguous_tokens(0), kv_end))
    while k_tok < kv_end:
        var n = min(TK, kc.contiguous_tokens(k_tok), kv_end - k_tok)
        var kp = kc.row_ptr(b, h, k_tok)
        var vp = vc.row_ptr(b, h, k_tok)
        _prefetch_rows[Cache](vp, n)  # read after QK and softmax
        var k_next = k_tok + n
        if k_next < kv_end:  # read after this tile's PV
            _prefetch_rows[Cache](kc.row_ptr(b, h, k_next), min(TK, kc.contiguous_tokens(k_next), kv_end - k_next))
        for r0 in range(0, rows_p, RB):
            for j0 in range(0, n, KB):
                _qk_block[Cache](qs, s, r0, kp, j0, n)
        var masked = k_tok + n - 1 > first_pos  # the diagonal tile: some keys are in the future
        for r in range(rows_p):
            var row_s = s.unsafe_offset(r * BK)
            if masked:
                var last = first_pos + r // group - k_tok  # last visible key of this row, tile-relative
                for j in range(max(last + 1, 0), n):
                    row_s.unsafe_store(j, Float32.MIN)
            var mv = SIMD[DType.float32, W](m.unsafe_load(r))
            var j = 0
            while j + W <= n:
                mv = max(mv, row_s.unsafe_load[width=W](j))
                j += W
            var mx = mv.reduce_max()
            while j < n:
                mx = max(mx, row_s.unsafe_load(j))
                j += 1
            var alpha = exp(m.unsafe_load(r) - mx)
            var sv = SIMD[DType.float32, W](0)
            j = 0
            while j + W <= n:
                var e = exp(row_s.unsafe_load[width=W](j) - mx)
                row_s.unsafe_store(j, e)
                sv += e
                j += W
            var sum = sv.reduce_add()
            while j < n:
                var e = exp(row_s.unsafe_load(j) - mx)
                row_s.unsafe_store(j, e)
                sum += e
                j += 1
            m.unsafe_store(r, mx)
            l.unsafe_store(r, l.unsafe_load(r) * alpha + sum)
            if alpha != 1:
                comptime for c in range(0, D, W):
                    o.unsafe_store(r * D + c, o.unsafe_load[width=W](r * D + c) * alpha)
        for r0 in range(0, rows_p, RB):
            _pv_block[Cache](o, s, r0, vp, n)
        k_tok += n

    for r in range(rows):
        var dst = output.unsafe_offset(((tok0 + r // group) * n_q + h * group + r % group) * D)
        var inv = 1 / l.unsafe_load(r)
        comptime for c in range(0, D, W):
            dst.unsafe_store(c, (o.unsafe_load[width=W](r * D + c) * inv).cast[q_dtype]())


def flash_attention[Coll: KVCollectionT, q_dtype: DType, target: StaticString](
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
    """Generic body of `mokv.flash_attention.ragged.*`."""
    comptime Cache = Coll.CacheType
    comptime H = Cache.kv_params.num_heads
    comptime D = Cache.kv_params.head_size
    var kc = coll.get_key_cache(layer_idx)
    var vc = coll.get_value_cache(layer_idx)
    var batch_size = coll.batch_size()
    var group = n_q // H

    comptime if is_cpu[target]():
        # Units are numbered tile-major then KV head; tile t of entry b starts at flat
        # token tile_start[t]. Build that table on the host (one Int per tile).
        var tq = max(1, MAX_ROWS // group)
        if group > MAX_ROWS:
            raise Error("mokv flash_attention (CPU): n_q / n_kv_heads must be <= ", MAX_ROWS)
        var tiles = List[Int]()
        for bb in range(batch_size):
            var t = Int(offsets[unsafe_offset=bb])
            var end = Int(offsets[unsafe_offset=bb + 1])
            while t < end:
                tiles.append(t)
                t += tq
        var tile_ptr = tiles.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var n_tiles = len(tiles)

        def body(unit: Int) {imm kc, imm vc, imm q, imm output, imm offsets, imm tile_ptr, imm batch_size, imm tq, imm group, imm n_q, imm scale}:
            var tok0 = tile_ptr.unsafe_load(unit // H)
            var h = unit % H
            var b = batch_of_token(offsets, batch_size, tok0)
            var start = Int(offsets[unsafe_offset=b])
            var ntok = min(tq, Int(offsets[unsafe_offset=b + 1]) - tok0)
            _attend_unit(kc, vc, q, output, b, h, tok0, tok0 - start, ntok, group, n_q, scale)

        sync_parallelize(body, n_tiles * H)
        _ = tiles^  # keep the table alive until every unit has run
    else:

        def kernel() {var kc, var vc, var q, var output, var offsets, var batch_size, var total_tokens, var n_q, var group, var scale}:
            var gid = Int(block_idx.x) * Int(block_dim.x) + Int(thread_idx.x)
            if gid >= total_tokens * n_q:
                return
            var tok = gid // n_q
            var qh = gid % n_q
            var h = qh // group
            var b = batch_of_token(offsets, batch_size, tok)
            var pos = kc.cache_length(b) + tok - Int(offsets[unsafe_offset=b])
            var qrow = q.unsafe_offset(gid * D)
            var acc = Array[Float32, D](fill=0)
            var m = Float32.MIN
            var l: Float32 = 0
            for key in range(pos + 1):
                var kr = kc.row_ptr(b, h, key)
                var sc: Float32 = 0
                for d in range(D):
                    sc += qrow.unsafe_load(d).cast[DType.float32]() * kr.unsafe_load(d).cast[DType.float32]()
                sc *= scale
                var mn = max(m, sc)
                var alpha = exp(m - mn)
                var pr = exp(sc - mn)
                l = l * alpha + pr
                var vr = vc.row_ptr(b, h, key)
                for d in range(D):
                    acc[d] = acc[d] * alpha + pr * vr.unsafe_load(d).cast[DType.float32]()
                m = mn
            var orow = output.unsafe_offset(gid * D)
            for d in range(D):
                orow.unsafe_store(d, (acc[d] / l).cast[q_dtype]())

        var n = total_tokens * n_q
        if n > 0:
            ctx.enqueue_function(kernel, grid_dim=ceildiv(n, 64), block_dim=64)
