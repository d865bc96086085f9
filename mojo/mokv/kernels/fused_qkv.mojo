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

Work unit: (block of TB tokens, one output head). Each weight row is read once per TB
tokens (weights dominate memory traffic for prefill); dot products accumulate in f32.
"""

from std.math import ceildiv
from std.memory import stack_allocation

from max.algorithm import sync_parallelize
from max.gpu import block_dim, block_idx, thread_idx
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu

from ..types import KVCacheT, KVCollectionT, Ptr, U32Ptr
from .ragged import batch_of_token

comptime F32Ptr = Pointer[Float32, MutUntrackedOrigin]


@always_inline
def _rope_pair(x0: Float32, x1: Float32, cos: Float32, sin: Float32) -> Tuple[Float32, Float32]:
    """Rotates the pair (x[i], x[i + D/2]) by the angle whose cos/sin are given."""
    return (x0 * cos - x1 * sin, x1 * cos + x0 * sin)


def _dot_rows[in_dtype: DType, TB: Int](
    hidden: Ptr[in_dtype], w_row: Ptr[in_dtype], tok0: Int, ntok: Int, K: Int, dst: F32Ptr, dst_stride: Int
):
    """dst[t * dst_stride] = dot(hidden[tok0 + t], w_row) for t < ntok (ntok <= TB), f32 accumulation."""
    comptime W = 16
    var acc = Array[SIMD[DType.float32, W], TB](fill=0)
    var k = 0
    while k + W <= K:
        var wv = w_row.unsafe_load[width=W](k).cast[DType.float32]()
        comptime for t in range(TB):
            if t < ntok:
                acc[t] += hidden.unsafe_load[width=W]((tok0 + t) * K + k).cast[DType.float32]() * wv
        k += W
    comptime for t in range(TB):
        if t < ntok:
            var s = acc[t].reduce_add()
            for kk in range(k, K):  # tail when hidden_size is not a multiple of W
                s += hidden.unsafe_load((tok0 + t) * K + kk).cast[DType.float32]() * w_row.unsafe_load(kk).cast[DType.float32]()
            dst.unsafe_store(t * dst_stride, s)


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
    var kc = coll.get_key_cache(layer_idx)
    var vc = coll.get_value_cache(layer_idx)
    var batch_size = coll.batch_size()
    var n_heads_all = n_q + 2 * H
    var K = hidden_size

    comptime if is_cpu[target]():
        comptime TB = 4
        var n_blocks = ceildiv(total_tokens, TB)

        def body(unit: Int) {imm kc, imm vc, imm q_out, imm hidden, imm wqkv, imm offsets, imm freqs, imm batch_size, imm n_q, imm n_heads_all, imm K, imm total_tokens}:
            var blk = unit // n_heads_all
            var j = unit % n_heads_all  # head across the three bands
            var tok0 = blk * TB
            var ntok = min(TB, total_tokens - tok0)
            var vptr = stack_allocation[TB * D, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
            for d in range(D):  # vals[t * D + d] = dot(hidden[tok0 + t], wqkv[j * D + d])
                _dot_rows[in_dtype, TB](hidden, wqkv.unsafe_offset((j * D + d) * K), tok0, ntok, K, vptr.unsafe_offset(d), D)
            var band = 0 if j < n_q else (1 if j < n_q + H else 2)
            var head = j - (0 if band == 0 else (n_q if band == 1 else n_q + H))
            for t in range(ntok):
                var tok = tok0 + t
                var b = batch_of_token(offsets, batch_size, tok)
                var pos = kc.cache_length(b) + tok - Int(offsets[unsafe_offset=b])
                _emit[Cache, in_dtype, rope](vptr.unsafe_offset(t * D), band, head, tok, pos, b, n_q, q_out, kc, vc, freqs)

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
