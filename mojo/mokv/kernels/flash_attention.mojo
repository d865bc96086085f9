"""Causal, grouped-query flash attention over a ragged batch and a KV cache layer.

    q   [total_tokens, n_q, D]   new tokens' queries (row offsets per batch entry)
    out [total_tokens, n_q, D]

New token `i` of entry `b` sits at position `p = cache_lengths[b] + i` and sees cache
positions [0, p]. The K/V of the new tokens must already be in the cache (store_kv or
fused_qkv_matmul ran first). Softmax is the online (flash) form in float32.

CPU design (decode is memory-bound, prefill compute-bound):
  * A work unit is (batch entry, KV head, tile of TQ new tokens). Its rows are every
    query head of the GQA group for those tokens: R = TQ * group <= 16 rows. One pass
    over the unit's keys serves all R rows, so in decode each K/V byte is read ONCE per
    GQA group (MAX 26.7's CPU kernel re-reads it per query head).
  * Keys are walked in tiles of at most BK tokens that never cross a page end
    (`contiguous_tokens`), so a tile is rows at one constant stride.
  * S = Q K^T for a block of RB rows keeps RB accumulators in registers while one K row
    is loaded and widened to f32 once; P V keeps RB x 2 accumulators per pair of
    16-lane column chunks while one V row chunk is loaded once.
  * Causality: the key loop stops at the tile's last visible position, so tiles the
    mask hides entirely are never read; only the diagonal tile applies a mask.
  * Units run in parallel with `sync_parallelize`.
GPU: one thread per (token, query head), a plain online-softmax loop (correct, simple).
"""

from std.math import ceildiv, exp
from std.memory import stack_allocation

from max.algorithm import sync_parallelize
from max.gpu import block_dim, block_idx, thread_idx
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu

from ..types import KVCacheT, KVCollectionT, Ptr, U32Ptr
from .ragged import batch_of_token

comptime F32Ptr = Pointer[Float32, MutUntrackedOrigin]
comptime W = 16  # f32 lanes of one AVX-512 register
comptime BK = 64  # keys per tile
comptime MAX_ROWS = 16  # query rows (tokens x group heads) per work unit
comptime RB = 4  # rows per register block


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
def _qk_block[Cache: KVCacheT, NR: Int](
    qs: F32Ptr,  # [R, D] scaled queries (f32)
    s: F32Ptr,  # [R, BK] scores of this tile
    r0: Int,
    kp: Ptr[Cache.dtype],  # first key row of the tile
    n: Int,
):
    """S[r0 .. r0+NR, :n] = Q[r0 .. r0+NR] . K[:n]^T; each key chunk is widened once for NR rows.

    (A 4-rows x 4-keys register block was tried: Mojo 1.2 spilled its `Array` of
    accumulators and decode got 2.5x slower, so one key at a time it is.)
    """
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    for j in range(n):
        var acc = Array[SIMD[DType.float32, W], NR](fill=0)
        comptime for c in range(0, D, W):
            var kv = _widen(kp, j * STRIDE + c)
            comptime for rr in range(NR):
                acc[rr] = qs.unsafe_load[width=W]((r0 + rr) * D + c).fma(kv, acc[rr])
        comptime for rr in range(NR):
            s.unsafe_store((r0 + rr) * BK + j, acc[rr].reduce_add())


@always_inline
def _pv_block[Cache: KVCacheT, NR: Int](
    o: F32Ptr,  # [R, D] output accumulators
    p: F32Ptr,  # [R, BK] probabilities of this tile
    r0: Int,
    vp: Ptr[Cache.dtype],  # first value row of the tile
    n: Int,
):
    """O[r0 .. r0+NR] += P[r0 .. r0+NR, :n] . V[:n]."""
    comptime D = Cache.kv_params.head_size
    comptime STRIDE = Cache.token_stride()
    comptime CW = 2 * W if D % (2 * W) == 0 else W  # two chunks per pass: 2*NR independent FMA chains
    comptime NC = CW // W
    comptime for c0 in range(0, D, CW):
        var acc = Array[SIMD[DType.float32, W], NR * NC](fill=0)
        for j in range(n):
            var pj = Array[SIMD[DType.float32, W], NR](fill=0)
            comptime for rr in range(NR):
                pj[rr] = SIMD[DType.float32, W](p.unsafe_load((r0 + rr) * BK + j))
            comptime for cc in range(NC):
                var vv = _widen(vp, j * STRIDE + c0 + cc * W)
                comptime for rr in range(NR):
                    acc[rr * NC + cc] = pj[rr].fma(vv, acc[rr * NC + cc])
        comptime for cc in range(NC):
            comptime for rr in range(NR):
                var off = (r0 + rr) * D + c0 + cc * W
                o.unsafe_store(off, o.unsafe_load[width=W](off) + acc[rr * NC + cc])


@always_inline
def _for_row_blocks[Cache: KVCacheT, qk: Bool](
    a: F32Ptr, b: F32Ptr, rows: Int, ptr: Ptr[Cache.dtype], n: Int
):
    """Runs the QK (qk=True: a=qs, b=s) or PV (a=o, b=p) block over all rows, RB at a time."""
    var r0 = 0
    while r0 + RB <= rows:
        comptime if qk:
            _qk_block[Cache, RB](a, b, r0, ptr, n)
        else:
            _pv_block[Cache, RB](a, b, r0, ptr, n)
        r0 += RB
    var rem = rows - r0
    comptime for t in range(1, RB):
        if rem == t:
            comptime if qk:
                _qk_block[Cache, t](a, b, r0, ptr, n)
            else:
                _pv_block[Cache, t](a, b, r0, ptr, n)


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
    var qs = stack_allocation[MAX_ROWS * D, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var o = stack_allocation[MAX_ROWS * D, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var s = stack_allocation[MAX_ROWS * BK, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var m = stack_allocation[MAX_ROWS, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    var l = stack_allocation[MAX_ROWS, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
    for r in range(rows):
        var src = q.unsafe_offset(((tok0 + r // group) * n_q + h * group + r % group) * D)
        comptime for c in range(0, D, W):
            qs.unsafe_store(r * D + c, src.unsafe_load[width=W](c).cast[DType.float32]() * scale)
            o.unsafe_store(r * D + c, SIMD[DType.float32, W](0))
        m.unsafe_store(r, Float32.MIN)
        l.unsafe_store(r, 0)

    var first_pos = kc.cache_length(b) + i0  # position of the tile's first token
    var kv_end = first_pos + ntok  # keys [0, kv_end) are visible to some row
    var k_tok = 0
    while k_tok < kv_end:
        var n = min(BK, kc.contiguous_tokens(k_tok), kv_end - k_tok)
        _for_row_blocks[Cache, True](qs, s, rows, kc.row_ptr(b, h, k_tok), n)
        var masked = k_tok + n - 1 > first_pos  # the diagonal tile: some keys are in the future
        for r in range(rows):
            var row_s = s.unsafe_offset(r * BK)
            if masked:
                var last = first_pos + r // group - k_tok  # last visible key of this row, tile-relative
                for j in range(max(last + 1, 0), n):
                    row_s.unsafe_store(j, Float32.MIN)
            var mx = m.unsafe_load(r)
            for j in range(n):
                mx = max(mx, row_s.unsafe_load(j))
            var alpha = exp(m.unsafe_load(r) - mx)
            var sum: Float32 = 0
            var j = 0
            while j + W <= n:
                var e = exp(row_s.unsafe_load[width=W](j) - mx)
                row_s.unsafe_store(j, e)
                sum += e.reduce_add()
                j += W
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
        _for_row_blocks[Cache, False](o, s, rows, vc.row_ptr(b, h, k_tok), n)
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
