"""Causal multi-head latent attention (MLA) over an MLA cache's pages on the CPU, in the
absorbed form DeepSeek's decode uses.

Un-absorbed, head `h` of a query at position `p` reads every key `j <= p` through the
up-projections of the cached latent `c_j` (`latent_dim`) and its RoPE key `r_j`:

    k_hj = [W_UK_h c_j ; r_j]     v_hj = W_UV_h c_j
    out_h = sum_j softmax_j(scale * q_h . k_hj) v_hj

Absorbed (the caller folds `W_UK_h` into the query and applies `W_UV_h` after), the
kernel never builds a key or a value: with `q'_h = [W_UK_h^T q_nope_h ; q_rope_h]`, the
score is one dot product with the cached row `[c_j ; r_j]`, and the output is a sum of
latents:

    o_h = sum_j softmax_j(scale * q'_h . [c_j ; r_j]) c_j      (out_h = W_UV_h o_h)

so every head of a token reads the same cached rows. A unit of work is one token and up
to `HEAD_GROUP` of its heads: each cached row is loaded once per unit and serves the
unit's heads (the reason MLA decode reads a seventh of GQA's bytes and still does as
many FLOPs). Rows are taken `KEY_BLOCK` at a time: the scores of the block for every
head of the unit, an online-softmax update per head, then the block's latents added
into the heads' accumulators, vectors of `W` lanes (kernels/cpu.mojo: 16 with
AVX-512F, 8 on the portable path), f32 accumulation whatever the cache's dtype. Both
passes run the unit's heads unrolled, one register each: a row's lane block is widened
once for all of them, and a lane block of the heads' accumulators stays in registers
over the block's rows (rescaled to the new maxima as it is loaded). Against a loop per
head over memory accumulators this took bench_mla's decode from 0.4-0.9 to 1.4-2.7 GB/s
(2026-11-28, Zen 4, 2 cores under a load of 7 to 12); scoring two rows per query load
and summing two lane blocks per probability broadcast moved it by less than the noise.

Prefill and decode are the same kernel: new token `i` of entry `b` is at position
`cache_lengths[b] + i` and reads keys `0 ..` that position (its own row, and those of
the entry's earlier new tokens, must be stored first: `mla_store`).
"""

from std.math import ceildiv, exp

from max.gpu.host import DeviceContext

from ...types import Ptr, U32Ptr
from ..cpu import W
from ..parallel import parallel_units
from ..ragged import batch_of_token
from ..simd import widen
from .mla_pages import LatentPages

comptime HEAD_GROUP = 8
"""Heads of one token in one unit of work: the rows a unit loads serve them all."""
comptime KEY_BLOCK = 16
"""Cached rows scored together before the softmax update (per head of the unit)."""


def mla_attention[dtype: DType, q_dtype: DType](
    pages: LatentPages[dtype],
    output: Ptr[q_dtype],  # [total_tokens, num_heads, latent_dim]
    q: Ptr[q_dtype],  # [total_tokens, num_heads, row_size]
    offsets: U32Ptr,  # [batch_size + 1]
    batch_size: Int,
    total_tokens: Int,
    num_heads: Int,
    latent_dim: Int,
    scale: Float32,
    ctx: DeviceContext,
) raises:
    """Writes each new token's absorbed attention output (module docstring). `row_size`
    (the cache's) and `latent_dim` are multiples of `W`."""
    var groups = ceildiv(num_heads, HEAD_GROUP)

    def unit(u: Int) {imm pages, imm output, imm q, imm offsets, imm batch_size, imm num_heads, imm latent_dim, imm scale, imm groups}:
        _mla_unit(pages, output, q, offsets, batch_size, num_heads, latent_dim, scale, u // groups, u % groups)

    parallel_units(unit, total_tokens * groups, ctx)


def _mla_unit[dtype: DType, q_dtype: DType](
    pages: LatentPages[dtype],
    output: Ptr[q_dtype],
    q: Ptr[q_dtype],
    offsets: U32Ptr,
    batch_size: Int,
    num_heads: Int,
    latent_dim: Int,
    scale: Float32,
    tok: Int,
    group: Int,
):
    """One token's heads `group * HEAD_GROUP ..`: every loop over a row's lanes runs the
    unit's `HEAD_GROUP` heads unrolled, each into a register of its own (a unit of fewer
    heads computes zero queries for the rest and never writes them)."""
    var D = pages.row_size
    var h0 = group * HEAD_GROUP
    var nh = min(HEAD_GROUP, num_heads - h0)
    var b = batch_of_token(offsets, batch_size, tok)
    var keys = pages.cache_length(b) + tok - Int(offsets[unsafe_offset=b]) + 1
    # The unit's queries in f32, pre-scaled; accumulators, running maxima and sums.
    var qs = List[Float32](length=HEAD_GROUP * D, fill=0)
    var acc = List[Float32](length=HEAD_GROUP * latent_dim, fill=0)
    var run_max = Array[Float32, HEAD_GROUP](fill=Float32.MIN)
    var run_sum = Array[Float32, HEAD_GROUP](fill=0)
    var alpha = Array[Float32, HEAD_GROUP](fill=1)
    var probs = List[Float32](length=HEAD_GROUP * KEY_BLOCK, fill=0)
    var rows = Array[Ptr[dtype], KEY_BLOCK](fill=pages.blocks)
    var qp = qs.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var ap = acc.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var pp = probs.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var src = q.unsafe_offset((tok * num_heads + h0) * D)
    for i in range(0, nh * D, W):
        qp.unsafe_store(i, widen[q_dtype](src, i) * scale)

    for k0 in range(0, keys, KEY_BLOCK):
        var kn = min(KEY_BLOCK, keys - k0)
        for j in range(kn):
            rows[j] = pages.row(b, k0 + j)
        # Scores: each row widened once per lane block, for every head of the unit, each
        # head summing into a register of its own.
        for j in range(kn):
            var s = Array[SIMD[DType.float32, W], HEAD_GROUP](fill=0)
            for d in range(0, D, W):
                var c = widen[dtype](rows[j], d)
                comptime for h in range(HEAD_GROUP):
                    s[h] = qp.unsafe_load[width=W](h * D + d).fma(c, s[h])
            comptime for h in range(HEAD_GROUP):
                pp.unsafe_store(h * KEY_BLOCK + j, s[h].reduce_add())
        # Online softmax: each head's new maximum, and the factor `alpha` that takes what
        # it has summed so far to it (applied as the values pass loads its accumulator).
        for h in range(nh):
            var block_max = Float32.MIN
            for j in range(kn):
                block_max = max(block_max, pp[unsafe_offset=h * KEY_BLOCK + j])
            var new_max = max(run_max[h], block_max)
            alpha[h] = exp(run_max[h] - new_max)
            var total = run_sum[h] * alpha[h]
            for j in range(kn):
                var p = exp(pp[unsafe_offset=h * KEY_BLOCK + j] - new_max)
                pp.unsafe_store(h * KEY_BLOCK + j, p)
                total += p
            run_max[h] = new_max
            run_sum[h] = total
        # Values: per lane block of the latent, the heads' accumulators stay in
        # registers over the block's rows.
        for d in range(0, latent_dim, W):
            var o = Array[SIMD[DType.float32, W], HEAD_GROUP](fill=0)
            comptime for h in range(HEAD_GROUP):
                o[h] = ap.unsafe_load[width=W](h * latent_dim + d) * alpha[h]
            for j in range(kn):
                var c = widen[dtype](rows[j], d)
                comptime for h in range(HEAD_GROUP):
                    var p = SIMD[DType.float32, W](pp[unsafe_offset=h * KEY_BLOCK + j])
                    o[h] = p.fma(c, o[h])
            comptime for h in range(HEAD_GROUP):
                ap.unsafe_store(h * latent_dim + d, o[h])

    var dst = output.unsafe_offset((tok * num_heads + h0) * latent_dim)
    for h in range(nh):
        var inv = 1 / run_sum[h]
        for d in range(0, latent_dim, W):
            var o = ap.unsafe_load[width=W](h * latent_dim + d) * inv
            dst.unsafe_store(h * latent_dim + d, o.cast[q_dtype]())
    # The untracked pointers above do not keep their lists alive: Mojo would free each
    # list after its `unsafe_ptr()`, its last tracked use.
    _ = qs^
    _ = acc^
    _ = probs^
