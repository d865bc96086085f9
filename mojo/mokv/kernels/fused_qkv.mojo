"""Fused QKV projection: Q out, K and V straight into the cache, optional RoPE.

    hidden [total_tokens, hidden_size] x wqkv^T, wqkv [(n_q + 2 * n_kv) * D, hidden_size]
    (row-major, output features first, like a Linear weight). Output feature rows come in
    three bands: Q heads, then K heads, then V heads, each head `D` rows.

Q goes to `q_out` [total_tokens, n_q * D]; K and V of new token `i` of entry `b` go to
the layer's cache at position `cache_lengths[b] + i`. With `rope`, Q and K are rotated
with the "rotate-half" pairing (x[i], x[i + D/2]) used by Llama / HF, at that position:

    freqs [max_seq_len, D] float32, row p = (cos t_0..cos t_{D/2-1}, sin t_0..sin t_{D/2-1})
    out[i]       = x[i] * cos t_i - x[i + D/2] * sin t_i
    out[i + D/2] = x[i + D/2] * cos t_i + x[i] * sin t_i

CPU work unit: (block of up to TB = 64 tokens, one output head of D features). Weights
dominate the memory traffic (a 4096 x 6144 f32 Wqkv is 100 MB), so each weight row is
read from memory once per 64 tokens; K is walked in chunks of KC so that a 4-feature
slice of the weights sits in L1 and the tokens' slice in L2 while 4-token x 4-feature
register blocks (16 dot products, one butterfly reduction per chunk) consume them.
The last ntok % 4 tokens (all of a decode step's) stream each weight row once, whole.
Dot products accumulate in f32. At 512 tokens x 4096 x 6144 this runs at ~150 GFLOP/s
on 2 cores (MAX's own matmul: ~320); a decode token reads the weights at ~30 GB/s.
"""

from std.math import ceildiv
from std.memory import stack_allocation

from max.algorithm import sync_parallelize
from max.gpu import block_dim, block_idx, thread_idx
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu

from ..types import KVCacheT, KVCollectionT, Ptr, U32Ptr
from .ragged import batch_of_token
from .simd import F32Ptr, W, reduce_16, widen

comptime TB = 64  # tokens per work unit: each weight row is read once per TB tokens
comptime KC = 512  # K chunk: 4 weight rows of it (8 KiB f32) stay in L1
comptime RT = 4  # tokens per register block
comptime RF = 4  # features per register block: RT * RF = 16 accumulators


@always_inline
def _rope_pair(x0: Float32, x1: Float32, cos: Float32, sin: Float32) -> Tuple[Float32, Float32]:
    """Rotates the pair (x[i], x[i + D/2]) by the angle whose cos/sin are given."""
    return (x0 * cos - x1 * sin, x1 * cos + x0 * sin)


@always_inline
def _dot_block[in_dtype: DType](
    hidden: Ptr[in_dtype],  # [total_tokens, K]
    wqkv: Ptr[in_dtype],  # [features, K]
    tok0: Int,
    f0: Int,  # first weight row (output feature)
    k0: Int,
    kn: Int,  # the K chunk [k0, k0 + kn)
    K: Int,
    acc_out: F32Ptr,  # [*, D] accumulators of the unit: row t, column f0 - head start
    D: Int,
):
    """acc_out[t, f] += dot(hidden[tok0 + t, chunk], wqkv[f0 + f, chunk]), RT x RF at once.

    RT * RF = 16 independent FMA chains per 16-element step (4 hidden + 4 weight loads
    feed 16 FMAs), reduced by one butterfly per chunk."""
    var hoff = Array[Int, RT](fill=0)
    comptime for t in range(RT):
        hoff[t] = (tok0 + t) * K
    var acc = Array[SIMD[DType.float32, W], W](fill=0)  # [t * RF + f]
    var k = k0
    while k + W <= k0 + kn:
        var wv = Array[SIMD[DType.float32, W], RF](fill=0)
        comptime for f in range(RF):
            wv[f] = widen(wqkv, (f0 + f) * K + k)
        comptime for t in range(RT):
            var hv = widen(hidden, hoff[t] + k)
            comptime for f in range(RF):
                acc[t * RF + f] = hv.fma(wv[f], acc[t * RF + f])
        k += W
    var sums = reduce_16(acc)
    comptime for t in range(RT):
        comptime for f in range(RF):
            var v = sums[t * RF + f]
            for kk in range(k, k0 + kn):  # the chunk's tail when it is not a multiple of W
                v += hidden.unsafe_load(hoff[t] + kk).cast[DType.float32]() * wqkv.unsafe_load((f0 + f) * K + kk).cast[DType.float32]()
            acc_out.unsafe_store(t * D + f, acc_out.unsafe_load(t * D + f) + v)


@always_inline
def _dot_row[in_dtype: DType](
    hidden: Ptr[in_dtype], w_row: Ptr[in_dtype], tok0: Int, ntok: Int, K: Int, dst: F32Ptr, D: Int
):
    """dst[t * D] = dot(hidden[tok0 + t], w_row) for the (< 4) tokens a unit has left
    over, as in decode: one weight row streamed straight through K serves them all
    (one stream at a time is what the prefetchers follow best)."""
    comptime MAX_TOK = RT - 1  # a unit's leftover tokens
    var acc = Array[SIMD[DType.float32, W], MAX_TOK](fill=0)
    var k = 0
    while k + W <= K:
        var wv = widen(w_row, k)
        comptime for t in range(MAX_TOK):
            if t < ntok:
                acc[t] = widen(hidden, (tok0 + t) * K + k).fma(wv, acc[t])
        k += W
    comptime for t in range(MAX_TOK):
        if t < ntok:
            var v = acc[t].reduce_add()
            for kk in range(k, K):  # tail when hidden_size is not a multiple of W
                v += hidden.unsafe_load((tok0 + t) * K + kk).cast[DType.float32]() * w_row.unsafe_load(kk).cast[DType.float32]()
            dst.unsafe_store(t * D, v)


@always_inline
def _emit[Cache: KVCacheT, in_dtype: DType, rope: Bool](
    vals: F32Ptr,  # [D] f32 projections of one (token, head)
    band: Int,  # 0 = Q, 1 = K, 2 = V
    head: Int,  # head index inside its band
    tok: Int,
    pos: Int,  # absolute position of the token in its sequence
    b: Int,
    n_q: Int,
    q_out: Ptr[in_dtype],
    kc: Cache,
    vc: Cache,
    freqs: F32Ptr,
):
    """Applies RoPE (Q, K bands) and writes one head's D values to Q or the cache."""
    comptime D = Cache.kv_params.head_size
    comptime HALF = D // 2
    comptime if rope:
        if band < 2:
            var f = freqs.unsafe_offset(pos * D)
            for i in range(HALF):
                var r = _rope_pair(vals.unsafe_load(i), vals.unsafe_load(i + HALF), f.unsafe_load(i), f.unsafe_load(i + HALF))
                vals.unsafe_store(i, r[0])
                vals.unsafe_store(i + HALF, r[1])
    if band == 0:
        var dst = q_out.unsafe_offset((tok * n_q + head) * D)
        for d in range(D):
            dst.unsafe_store(d, vals.unsafe_load(d).cast[in_dtype]())
    else:
        var dst = kc.row_ptr(b, head, pos) if band == 1 else vc.row_ptr(b, head, pos)
        for d in range(D):
            dst.unsafe_store(d, vals.unsafe_load(d).cast[Cache.dtype]())


def fused_qkv_matmul[Coll: KVCollectionT, in_dtype: DType, rope: Bool, target: StaticString](
    coll: Coll,
    q_out: Ptr[in_dtype],  # [total_tokens, n_q * D]
    hidden: Ptr[in_dtype],  # [total_tokens, hidden_size]
    wqkv: Ptr[in_dtype],  # [(n_q + 2 * n_kv) * D, hidden_size]
    offsets: U32Ptr,  # [batch_size + 1]
    freqs: F32Ptr,  # [max_seq_len, D] when rope, else unused
    total_tokens: Int,
    hidden_size: Int,
    n_q: Int,
    layer_idx: Int,
    ctx: DeviceContext,
) raises:
    """Generic body of `mokv.fused_qkv_matmul.ragged.*` (and `.rope`)."""
    comptime Cache = Coll.CacheType
    comptime H = Cache.kv_params.num_heads
    comptime D = Cache.kv_params.head_size
    comptime assert not rope or D % 2 == 0, "RoPE needs an even head_size"
    comptime assert not is_cpu[target]() or D % W == 0, "head_size must be a multiple of 16 on CPU"
    var kc = coll.get_key_cache(layer_idx)
    var vc = coll.get_value_cache(layer_idx)
    var batch_size = coll.batch_size()
    var n_heads_all = n_q + 2 * H
    var K = hidden_size

    comptime if is_cpu[target]():
        var n_blocks = ceildiv(total_tokens, TB)

        def body(unit: Int) {imm kc, imm vc, imm q_out, imm hidden, imm wqkv, imm offsets, imm freqs, imm batch_size, imm n_q, imm n_heads_all, imm K, imm total_tokens}:
            var blk = unit // n_heads_all
            var j = unit % n_heads_all  # head across the three bands
            var tok0 = blk * TB
            var ntok = min(TB, total_tokens - tok0)
            var vals = stack_allocation[TB * D, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
            for i in range(ntok * D):
                vals.unsafe_store(i, 0)
            var quads = ntok - ntok % RT  # tokens in 4-token register blocks; the rest: _dot_row
            for k0 in range(0, K, KC):
                var kn = min(KC, K - k0)
                for f0 in range(0, D, RF):  # RF weight rows of the chunk stay in L1 ...
                    for t0 in range(0, quads, RT):  # ... while the unit's tokens pass by
                        _dot_block[in_dtype](hidden, wqkv, tok0 + t0, j * D + f0, k0, kn, K,
                                             vals.unsafe_offset(t0 * D + f0), D)
            if quads < ntok:
                for d in range(D):
                    _dot_row(hidden, wqkv.unsafe_offset((j * D + d) * K), tok0 + quads, ntok - quads, K,
                             vals.unsafe_offset(quads * D + d), D)
            var band = 0 if j < n_q else (1 if j < n_q + H else 2)
            var head = j - (0 if band == 0 else (n_q if band == 1 else n_q + H))
            for t in range(ntok):
                var tok = tok0 + t
                var b = batch_of_token(offsets, batch_size, tok)
                var pos = kc.cache_length(b) + tok - Int(offsets[unsafe_offset=b])
                _emit[Cache, in_dtype, rope](vals.unsafe_offset(t * D), band, head, tok, pos, b, n_q, q_out, kc, vc, freqs)

        sync_parallelize(body, n_blocks * n_heads_all)
    else:
        # One block per (token, head); thread d computes output feature d (and, with
        # RoPE, its partner d +- D/2 too, which avoids shared memory and a barrier).
        def kernel() {var kc, var vc, var q_out, var hidden, var wqkv, var offsets, var freqs, var batch_size, var n_q, var K}:
            var tok = Int(block_idx.x)
            var j = Int(block_idx.y)
            var d = Int(thread_idx.x)
            if d >= D:
                return
            var b = batch_of_token(offsets, batch_size, tok)
            var pos = kc.cache_length(b) + tok - Int(offsets[unsafe_offset=b])

            @always_inline
            def dot(row: Int) {var hidden, var wqkv, var K, var tok} -> Float32:
                var s: Float32 = 0
                for k in range(K):
                    s += hidden.unsafe_load(tok * K + k).cast[DType.float32]() * wqkv.unsafe_load(row * K + k).cast[DType.float32]()
                return s

            var x = dot(j * D + d)
            var band = 0 if j < n_q else (1 if j < n_q + H else 2)
            var head = j - (0 if band == 0 else (n_q if band == 1 else n_q + H))
            comptime if rope:
                if band < 2:
                    comptime HALF = D // 2
                    var i = d % HALF
                    var partner = dot(j * D + (d + HALF) % D)
                    var cos = freqs.unsafe_load(pos * D + i)
                    var sin = freqs.unsafe_load(pos * D + HALF + i)
                    x = x * cos - partner * sin if d < HALF else x * cos + partner * sin
            if band == 0:
                q_out.unsafe_store((tok * n_q + head) * D + d, x.cast[in_dtype]())
            elif band == 1:
                kc.row_ptr(b, head, pos).unsafe_store(d, x.cast[Cache.dtype]())
            else:
                vc.row_ptr(b, head, pos).unsafe_store(d, x.cast[Cache.dtype]())

        if total_tokens > 0:
            ctx.enqueue_function(kernel, grid_dim=(total_tokens, n_heads_all), block_dim=D)
