"""Fused QKV projection: Q out, K and V straight into the cache, optional RoPE.

On an NVIDIA GPU a bf16/f16 projection is MAX's matmul (tensor cores) and `qkv_epilogue`
does the rest; otherwise one block per (token, head) computes plain dot products (`_qkv_gpu`).
Everything below about blocking is the CPU kernel.

    hidden [total_tokens, hidden_size] x wqkv^T, wqkv [(n_q + 2 * n_kv) * D, hidden_size]
    (row-major, output features first, like a Linear weight). Output feature rows come in
    three bands: Q heads, then K heads, then V heads, each head `D` rows.

Q goes to `q_out` [total_tokens, n_q * D]; K and V of new token `i` of entry `b` go to
the layer's cache at position `cache_lengths[b] + i`. With `rope`, Q and K are rotated
with the "rotate-half" pairing (x[i], x[i + D/2]) used by Llama / HF, at that position:

    freqs [max_seq_len, D] float32, row p = (cos t_0..cos t_{D/2-1}, sin t_0..sin t_{D/2-1})
    out[i]       = x[i] * cos t_i - x[i + D/2] * sin t_i
    out[i + D/2] = x[i + D/2] * cos t_i + x[i] * sin t_i

CPU, two paths (dot products accumulate in f32 in both):
  * Packed (>= PACK_MIN_TOKENS = 16 tokens in the call, `_fused_qkv_packed`): hidden^T
    is packed once per call as f32 [K, tokens] (T x K elements: 1/12 of the weights at
    Llama-3-8B shapes, so packing costs ~1 % at 512 tokens), and a broadcast-FMA
    micro-kernel computes C^T = W H^T in MR-feature x 3W-token register blocks (MR = 8
    with AVX-512's 32 registers, 4 with 16: 24 or 12 accumulators; per k: 3 token
    vectors + MR broadcast weights, no horizontal sums).
    A unit is (block of up to 512 tokens, one output head), so each weight byte is read
    from memory once per 512 tokens. The weights are used in place: nothing is packed
    or cached across calls (the weight is a graph input; a pack keyed by its pointer
    would go stale when a buffer is freed and reused, and W^T packing would cost a
    pass over 100 MB per call). Replaced 64-token units with 4 x 4 dot-product blocks
    and a butterfly per chunk, which re-read the weights 8 times at 512 tokens and ran
    at ~60 % of MAX's matmul.
  * Streaming (fewer tokens, e.g. decode): units of up to TB = 64 tokens x one head;
    4-token x RF-feature register blocks (RF = W / 4) over K chunks of KC, and the last ntok % 4
    tokens stream each weight row once, whole (a decode token reads the weights at
    ~30 GB/s, 1.7-1.9x MAX's matmul).
"""

from std.math import ceildiv
from std.memory import stack_allocation
from std.sys.info import size_of
from std.sys.intrinsics import prefetch, PrefetchOptions

from max.gpu import block_idx, thread_idx
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu

from ..types import KVCacheT, KVCollectionT, Ptr, U32Ptr
from .parallel import parallel_units
from .ragged import batch_of_token
from .cpu import VECTOR_REGISTERS, W
from .fp8 import store_row
from .simd import F32Ptr, lane_sums, widen
from .unscaled_fp8 import saturated

comptime TB = 64  # tokens per work unit: each weight row is read once per TB tokens
comptime KC = 512  # K chunk: 4 weight rows of it (8 KiB f32) stay in L1
comptime RT = 4  # tokens per register block
comptime RF = W // RT  # features per register block: RT * RF = W accumulators

# Packed (broadcast-FMA) path for prefill chunks of at least PACK_MIN_TOKENS tokens.
comptime PACK_MIN_TOKENS = 16
comptime PTB = 512  # tokens per packed work unit: a head's weights are read once per PTB tokens
comptime PKC = 256  # K chunk of the packed path: H^T chunk [PKC, PTB] f32 (512 KiB) stays in L2
comptime MR = 8 if VECTOR_REGISTERS >= 32 else 4  # weight rows (broadcast) per register block
comptime NR = 3  # token vectors per register block: MR * NR = 24 or 12 accumulators


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

    RT * RF = W independent FMA chains per W-element step (4 hidden + RF weight loads
    feed W FMAs), reduced by one butterfly per chunk."""
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
    var sums = lane_sums(acc)
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
def _mk_packed[nr: Int](
    wp: F32Ptr,  # MR weight rows of this K chunk, f32, `ws` apart
    ws: Int,
    ht: F32Ptr,  # the token panel's H^T chunk: element (k, t) at ht[k * nr * W + t]
    kn: Int,
    c: F32Ptr,  # C^T [features, ts]: row f at c[f * ts], columns from the panel's first token
    ts: Int,
):
    """C^T[f, t .. t + nr*W] += sum_k W[f, k] * H^T[k, t .. t + nr*W] for MR features.

    Broadcast-FMA: per k, nr token vectors (contiguous in the packed H^T) and MR
    broadcast weights feed MR * nr FMAs; no horizontal sums. With nr = 3 that is
    MR * 3 accumulators + 3 vectors + 1 broadcast: 28 of AVX-512's 32 registers (MR =
    8), 16 of 16 (MR = 4)."""
    var acc = Array[SIMD[DType.float32, W], MR * nr](fill=0)  # [i * nr + j]
    for k in range(kn):
        var hv = Array[SIMD[DType.float32, W], nr](fill=0)
        comptime for j in range(nr):
            hv[j] = ht.unsafe_load[width=W](k * (nr * W) + j * W)
        comptime for i in range(MR):
            var wb = SIMD[DType.float32, W](wp.unsafe_load(i * ws + k))
            comptime for j in range(nr):
                acc[i * nr + j] = wb.fma(hv[j], acc[i * nr + j])
    comptime for i in range(MR):
        comptime for j in range(nr):
            var off = i * ts + j * W
            c.unsafe_store(off, c.unsafe_load[width=W](off) + acc[i * nr + j])


@always_inline
def _prefetch_strip[dtype: DType](w: Ptr[dtype], K: Int, kn: Int):
    """Prefetches MR weight rows' [0, kn) slices (K apart) into L2: short runs 16 KiB
    apart, which the hardware prefetchers pick up too late to hide DRAM latency."""
    comptime LINE_ELEMS = 64 // size_of[Scalar[dtype]]()
    comptime for i in range(MR):
        for kk in range(0, kn, LINE_ELEMS):
            prefetch[PrefetchOptions().for_read().medium_locality()](w.unsafe_offset(i * K + kk))


@always_inline
def _pack_ht[in_dtype: DType](
    hidden: Ptr[in_dtype], ht: F32Ptr, tok0: Int, ntok: Int, ts: Int, k0: Int, kn: Int, K: Int
):
    """Packs hidden[tok0 : tok0 + ntok, k0 : k0 + kn]^T as f32 token panels: panel p
    holds tokens [PW p, PW p + pw), pw = min(PW, ts - PW p), PW = NR * W, at
    ht[PW p * K + k * pw + t - PW p], so the micro-kernel reads each panel's K chunk
    as one contiguous run (a [K, ts] layout put rows 2 KiB apart at 512 tokens: a few
    L1 sets, many pages). Padding tokens ntok <= t < ts are zeros. W elements of a
    hidden row are loaded (and bf16 widened) at once and scattered down a column."""
    comptime PW = NR * W
    for t in range(ts):
        var p0 = (t // PW) * PW
        var pw = min(PW, ts - p0)
        var dst = ht.unsafe_offset(p0 * K + t - p0)
        var k = k0
        while k + W <= k0 + kn:
            var v = widen(hidden, (tok0 + t) * K + k) if t < ntok else SIMD[DType.float32, W](0)
            comptime for i in range(W):
                dst.unsafe_store((k + i) * pw, v[i])
            k += W
        while k < k0 + kn:
            dst.unsafe_store(k * pw, hidden.unsafe_load((tok0 + t) * K + k).cast[DType.float32]() if t < ntok else 0)
            k += 1


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
        store_row(kc if band == 1 else vc, b, head, pos, vals)


def _fused_qkv_packed[Coll: KVCollectionT, in_dtype: DType, rope: Bool](
    kc: Coll.CacheType,
    vc: Coll.CacheType,
    q_out: Ptr[in_dtype],
    hidden: Ptr[in_dtype],
    wqkv: Ptr[in_dtype],
    offsets: U32Ptr,
    freqs: F32Ptr,
    total_tokens: Int,
    K: Int,
    n_q: Int,
    batch_size: Int,
    ctx: DeviceContext,
) raises:
    """The CPU path for prefill chunks: broadcast-FMA over a packed H^T.

    Phase 1 packs hidden^T once per call, f32, per block of PTB tokens, as panels of
    3W tokens x K (`_pack_ht`; ts = the block's tokens rounded up to W, zero columns). That is T x K elements,
    1/12 of the weights' size at Llama-3-8B shapes, and it is what the micro-kernel
    reads contiguously. The weights are read in place (no W^T pack, nothing cached
    across calls: the weight is a graph input whose buffer may change or move
    between calls). float32 weights are broadcast straight from their rows; bf16
    rows are widened per K chunk into a contiguous [MR, PKC] f32 strip (8 KiB, L1).
    Copying f32 rows into such a strip too (against L1 set conflicts of rows 16 KiB
    apart) cost 2-4 % of the CPU time at 512 tokens and 6-10 % at 128, measured
    alternating with the direct reads; the micro-kernel then runs at about the FMA
    peak of this machine (~105 GFLOP/s per core, one zmm FMA per cycle), measured by
    CPU time outside a graph.
    Phase 2: a unit is (token block, one head of D output features); each head's
    weights are read once per PTB tokens. The unit accumulates C^T [D, ts] and then
    emits token by token (RoPE, Q out, K/V into the cache) as the streaming path does.
    """
    comptime Cache = Coll.CacheType
    comptime H = Cache.kv_params.num_heads
    comptime D = Cache.kv_params.head_size
    comptime assert D % MR == 0, "head_size must be a multiple of MR"
    var n_heads_all = n_q + 2 * H
    var n_blocks = ceildiv(total_tokens, PTB)
    var ts_full = ceildiv(min(total_tokens, PTB), W) * W
    var block_elems = K * ts_full
    var ht_buf = List[Float32](capacity=n_blocks * block_elems)
    var ht_all = ht_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var k_slabs = ceildiv(K, PKC)

    def pack(task: Int) {imm hidden, imm ht_all, imm total_tokens, imm K, imm ts_full, imm block_elems, imm k_slabs}:
        var blk = task // k_slabs
        var k0 = (task % k_slabs) * PKC
        var tok0 = blk * PTB
        var ntok = min(PTB, total_tokens - tok0)
        var ts = ceildiv(ntok, W) * W
        _pack_ht[in_dtype](hidden, ht_all.unsafe_offset(blk * block_elems), tok0, ntok, ts, k0, min(PKC, K - k0), K)

    parallel_units(pack, n_blocks * k_slabs, ctx)

    def body(unit: Int) {imm kc, imm vc, imm q_out, imm wqkv, imm offsets, imm freqs, imm ht_all, imm batch_size, imm n_q, imm n_heads_all, imm K, imm total_tokens, imm block_elems}:
        var blk = unit // n_heads_all
        var j = unit % n_heads_all  # head across the three bands
        var tok0 = blk * PTB
        var ntok = min(PTB, total_tokens - tok0)
        var ts = ceildiv(ntok, W) * W
        var ht = ht_all.unsafe_offset(blk * block_elems)
        var c_buf = List[Float32](length=D * ts, fill=0)
        var c = c_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var strip = stack_allocation[MR * PKC, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
        # float32 rows are broadcast in place (see above); with one register block of
        # tokens (<= 3W) each weight element is used once, so K is not chunked then:
        # the rows stream whole (8 sequential streams). bf16 goes through the strip.
        var direct = in_dtype == DType.float32
        var kstep = K if direct and ts <= NR * W else PKC
        for k0 in range(0, K, kstep):
            var kn = min(kstep, K - k0)
            for f0 in range(0, D, MR):
                var w0 = wqkv.unsafe_offset((j * D + f0) * K + k0)
                var wp = strip
                var ws = PKC
                comptime if in_dtype == DType.float32:
                    if direct:
                        wp = rebind[F32Ptr](w0)
                        ws = K
                if not direct:
                    comptime for i in range(MR):
                        var kk = 0
                        while kk + W <= kn:
                            strip.unsafe_store(i * PKC + kk, widen(w0, i * K + kk))
                            kk += W
                        while kk < kn:
                            strip.unsafe_store(i * PKC + kk, w0.unsafe_load(i * K + kk).cast[DType.float32]())
                            kk += 1
                    if f0 + MR < D:  # the next strip's rows, while this one is computed on
                        _prefetch_strip(w0.unsafe_offset(MR * K), K, kn)
                var cf = c.unsafe_offset(f0 * ts)
                var t0 = 0
                while t0 + NR * W <= ts:
                    var hp = ht.unsafe_offset(t0 * K + k0 * (NR * W))
                    _mk_packed[NR](wp, ws, hp, kn, cf.unsafe_offset(t0), ts)
                    t0 += NR * W
                if ts - t0 == 2 * W:
                    _mk_packed[2](wp, ws, ht.unsafe_offset(t0 * K + k0 * (2 * W)), kn, cf.unsafe_offset(t0), ts)
                elif ts - t0 == W:
                    _mk_packed[1](wp, ws, ht.unsafe_offset(t0 * K + k0 * W), kn, cf.unsafe_offset(t0), ts)
        var band = 0 if j < n_q else (1 if j < n_q + H else 2)
        var head = j - (0 if band == 0 else (n_q if band == 1 else n_q + H))
        # C^T is feature-major; the emit wants each token's D values together. W tokens
        # at a time, each feature's W values are one vector load, scattered into an L1
        # buffer of W rows (a load per value, D x ts apart, cost ~5 % of the call at 512
        # tokens, Zen 5: most of the gap to MAX's matmul there).
        var rows = stack_allocation[W * D, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
        for t0 in range(0, ntok, W):
            for d in range(D):
                var col = c.unsafe_load[width=W](d * ts + t0)  # ts is a multiple of W
                comptime for i in range(W):
                    rows.unsafe_store(i * D + d, col[i])
            for i in range(min(W, ntok - t0)):
                var tok = tok0 + t0 + i
                var b = batch_of_token(offsets, batch_size, tok)
                var pos = kc.cache_length(b) + tok - Int(offsets[unsafe_offset=b])
                _emit[Cache, in_dtype, rope](rows.unsafe_offset(i * D), band, head, tok, pos, b, n_q, q_out, kc, vc, freqs)
        _ = c_buf^

    parallel_units(body, n_blocks * n_heads_all, ctx)
    _ = ht_buf^


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
        if total_tokens >= PACK_MIN_TOKENS:
            _fused_qkv_packed[Coll, in_dtype, rope](kc, vc, q_out, hidden, wqkv, offsets, freqs, total_tokens, K, n_q, batch_size, ctx)
            return
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

        parallel_units(body, n_blocks * n_heads_all, ctx)
    else:
        # float32 and AMD GPUs (python/mokv/ops/matmul.py says why): plain dot products.
        _qkv_gpu[Coll, in_dtype, rope, project=True](coll, q_out, hidden, wqkv, offsets, freqs, total_tokens, K, n_q, layer_idx, ctx)


def qkv_epilogue[Coll: KVCollectionT, in_dtype: DType, rope: Bool, target: StaticString](
    coll: Coll,
    q_out: Ptr[in_dtype],  # [total_tokens, n_q * D]
    qkv: Ptr[in_dtype],  # [total_tokens, (n_q + 2 * n_kv) * D]: hidden x wqkv^T
    offsets: U32Ptr,  # [batch_size + 1]
    freqs: F32Ptr,  # [max_seq_len, D] when rope, else unused
    total_tokens: Int,
    n_q: Int,
    layer_idx: Int,
    ctx: DeviceContext,
) raises:
    """Generic body of `mokv.qkv_epilogue.ragged.*` (and `.rope`): the rest of the fused
    QKV projection on an NVIDIA GPU, after MAX's matmul (tensor cores) in the graph."""
    comptime if is_cpu[target]():
        raise Error("mokv.qkv_epilogue runs on a GPU (the CPU fuses it into mokv.fused_qkv_matmul)")
    else:
        _qkv_gpu[Coll, in_dtype, rope, project=False](coll, q_out, qkv, q_out, offsets, freqs, total_tokens, 0, n_q, layer_idx, ctx)


@always_inline
def _qkv_feature[in_dtype: DType, D: Int, project: Bool](
    src: Ptr[in_dtype], wqkv: Ptr[in_dtype], K: Int, tok: Int, j: Int, n_heads_all: Int, f: Int
) -> Float32:
    """Feature f of head j (across the three bands) of token tok: its dot product, or
    its entry of the projections."""
    comptime if project:
        var s: Float32 = 0
        for k in range(K):
            s += src.unsafe_load(tok * K + k).cast[DType.float32]() * wqkv.unsafe_load((j * D + f) * K + k).cast[DType.float32]()
        return s
    else:
        return src.unsafe_load((tok * n_heads_all + j) * D + f).cast[DType.float32]()


@always_inline
def _qkv_value[in_dtype: DType, D: Int, project: Bool](
    src: Ptr[in_dtype], wqkv: Ptr[in_dtype], freqs: F32Ptr, K: Int, tok: Int, j: Int, n_heads_all: Int, pos: Int, rotate: Bool, f: Int
) -> Float32:
    """Feature f as it is stored: rotated with its partner f +- D/2 when `rotate`."""
    var x = _qkv_feature[in_dtype, D, project](src, wqkv, K, tok, j, n_heads_all, f)
    if rotate:
        comptime HALF = D // 2
        var i = f % HALF
        var partner = _qkv_feature[in_dtype, D, project](src, wqkv, K, tok, j, n_heads_all, (f + HALF) % D)
        var cos = freqs.unsafe_load(pos * D + i)
        var sin = freqs.unsafe_load(pos * D + HALF + i)
        x = x * cos - partner * sin if f < HALF else x * cos + partner * sin
    return x


def _qkv_gpu[Coll: KVCollectionT, in_dtype: DType, rope: Bool, project: Bool](
    coll: Coll,
    q_out: Ptr[in_dtype],  # [total_tokens, n_q * D]
    src: Ptr[in_dtype],  # project: hidden [total_tokens, K]; else the projections [total_tokens, n_all * D]
    wqkv: Ptr[in_dtype],  # project: [n_all * D, K]; else unused
    offsets: U32Ptr,
    freqs: F32Ptr,
    total_tokens: Int,
    K: Int,  # hidden size (project only)
    n_q: Int,
    layer_idx: Int,
    ctx: DeviceContext,
) raises:
    """RoPE, Q out, K and V into the cache, on a GPU; with `project`, each feature's dot
    product first. One block per (token, head); thread d handles feature d (and, with
    RoPE, its partner d +- D/2 too, which avoids shared memory and a barrier). Into
    scaled FP8 pages, thread 0 of a K or V head computes the head's whole row and
    quantizes it with the CPU's `store_row` (a scale needs the row's absmax); into MAX's
    unscaled FP8 pages each value is cast, saturated (kernels/unscaled_fp8.mojo)."""
    comptime Cache = Coll.CacheType
    comptime H = Cache.kv_params.num_heads
    comptime D = Cache.kv_params.head_size
    comptime assert not rope or D % 2 == 0, "RoPE needs an even head_size"
    var kc = coll.get_key_cache(layer_idx)
    var vc = coll.get_value_cache(layer_idx)
    var batch_size = coll.batch_size()
    var n_heads_all = n_q + 2 * H

    def kernel() {var kc, var vc, var q_out, var src, var wqkv, var offsets, var freqs, var batch_size, var n_q, var n_heads_all, var K}:
        var tok = Int(block_idx.x)
        var j = Int(block_idx.y)
        var d = Int(thread_idx.x)
        var b = batch_of_token(offsets, batch_size, tok)
        var pos = kc.cache_length(b) + tok - Int(offsets[unsafe_offset=b])
        var band = 0 if j < n_q else (1 if j < n_q + H else 2)
        var head = j - (0 if band == 0 else (n_q if band == 1 else n_q + H))
        var rotate = rope and band < 2
        if band == 0:
            var x = _qkv_value[in_dtype, D, project](src, wqkv, freqs, K, tok, j, n_heads_all, pos, rotate, d)
            q_out.unsafe_store((tok * n_q + head) * D + d, x.cast[in_dtype]())
            return
        var cache = kc if band == 1 else vc
        comptime if Coll.scaled:
            if d == 0:
                var row = stack_allocation[D, Float32]().unsafe_origin_cast[MutUntrackedOrigin]()
                for f in range(D):
                    row.unsafe_store(f, _qkv_value[in_dtype, D, project](src, wqkv, freqs, K, tok, j, n_heads_all, pos, rotate, f))
                store_row(cache, b, head, pos, row)
        else:
            var x = _qkv_value[in_dtype, D, project](src, wqkv, freqs, K, tok, j, n_heads_all, pos, rotate, d)
            cache.row_ptr(b, head, pos).unsafe_store(d, saturated[Cache.dtype](x))

    if total_tokens > 0:
        ctx.enqueue_function(kernel, grid_dim=(total_tokens, n_heads_all), block_dim=D)
