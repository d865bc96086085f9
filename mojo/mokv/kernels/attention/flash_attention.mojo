"""Causal, grouped-query flash attention over a ragged batch and a KV cache layer.

    q   [total_tokens, n_q, D]   new tokens' queries (row offsets per batch entry)
    out [total_tokens, n_q, D]

New token `i` of entry `b` sits at position `p = cache_lengths[b] + i` and sees cache
positions [0, p]. The K/V of the new tokens must already be in the cache (store_kv or
fused_qkv_matmul ran first). Softmax is the online (flash) form in float32, taken in
powers of 2 against a reference maximum raised lazily (`softmax_key_major`).

CPU design (decode is memory-bound, prefill compute-bound). The counts below are for
AVX-512's W = 16 lanes; the portable paths (kernels/cpu.mojo) take W = 8, with half the
lanes and accumulators per register block alike:
  * A work unit is (batch entry, tile of new tokens, block of KV heads, range of keys).
    Its rows are every query head of the GQA group for those tokens and heads, at
    most MAX_ROWS = 64. One pass over the unit's keys serves all its rows, so each K/V
    byte is read ONCE per GQA group (MAX 26.7's CPU kernel re-reads it per query
    head), and in prefill a K/V tile loaded into L1 serves 64 rows.
  * Decode (fewer than W rows per head): a unit takes as many KV heads as fit, so it
    reads each key tile's heads in address order. When batch x head blocks leaves
    too few units for the cores (one long sequence), the keys are split across
    units (flash-decoding), and the last split of a unit to finish combines their
    softmax states (`merge_parts`).
  * Keys are walked in tiles of at most 64 tokens that never cross a page end
    (`contiguous_tokens`), so a tile is rows at one constant stride: 16 KiB of one
    head's K staged as f32 (prefill), 8 KiB of it as stored (decode).
    Halving the decode tile from 16 KiB sped up decode at 16k context by 2-15 %
    (bf16 GQA 4 the most, f32 GQA 4 the least; 4 and 12 KiB tiles were slower),
    measured with the sizes alternating in one run. Each head's V rows of a tile and
    K rows of the next tile are prefetched in software while the tile before them is
    computed on, spread over the inner loops (`prefetch_spread` gives the numbers).
  * Scores are kept key-major, S^T [keys, rows], in every form, so one softmax serves
    all units and runs lane-wise over 16 rows, with no horizontal sums. Decode reads
    K as stored, in the form that fits its rows per head: 8 and 4 (GQA 8 and 4) in
    vectors of 8 or 16 lanes (`NARROW_LANES`, by CPU) with groups of key elements
    broadcast from the cache (`qk_narrow`), or, for bf16 where `vdpbf16ps` runs at
    half rate, two rows per vector over keys widened in registers (`qk_row_pairs`);
    1 (GQA 1) one key x 16 heads per butterfly, reading a key's rows in address order
    (`qk_heads`); 12 (a few new tokens) in 4-row x 4-key register blocks, 16 FMA
    chains over D reduced by one butterfly (`qk_block`). Each gives its measurements.
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
  * FP8 caches (float8_e4m3fn values, a float32 scale per 128 lanes): decode units
    read the bytes in the decode forms, widened in registers without their scale,
    and fold each key's scale (times 256) into its summed scores (`qk_block`,
    `qk_heads`) and into its probabilities in P V (`pv_block`), one multiply per key
    and row instead of one per element. With BF16_DOT (AVX-512 BF16) the bytes widen
    to bf16, exactly (`simd.widen_bf16`: e4m3fn's 4 exponent and 3 mantissa bits fit
    bf16's 8 and 7; subnormals through a table), and scores and P V take `vdpbf16ps`
    as bf16 caches do, Q rounded to bf16 once per query and P times each key's V
    scale rounded to bf16 once per tile (`softmax_key_major`): the same rounding, so
    the same accuracy, as bf16 decode. Elsewhere they widen to f32 (`simd.widen`:
    through float16, three integer ops and `vcvtph2ps` per vector) for f32 FMAs. GQA
    8 and 4 heads take `qk_block` rather than `qk_narrow`: it widens a vector of a
    key's bytes once for 4 rows, where `qk_narrow` widens a group of one or two bytes
    per FMA. Prefill units stage each tile as f32, dequantized (q * scale rounded
    once: `fp8.stage_scaled_tile`). Heads of several scale blocks (256 lanes) stage in
    decode too (`STAGED_UNITS`).
  * Causality: the key loop stops at the unit's last visible position, so tiles the
    mask hides entirely are never read; only the diagonal tile applies a mask.
  * A sliding window (`window` keys, the query's own included; Gemma 3's local layers)
    starts a unit's key loop at its first token's window, so a decode step reads
    `window` keys whatever the sequence's length; the tiles before a later token's
    window are masked for its rows (`softmax_key_major`), whose reference stays finite
    (`NO_KEY`) until their first key.
  * Units run in parallel on the op's device context (`parallel_units`).
On a GPU the ops run MAX's attention kernel on a MAX view of the cache instead
(kernels/max_kernels.mojo).
"""

from std.atomic import Atomic

from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu

from ...types import KVCollectionT, Ptr, U32Ptr
from ..parallel import parallel_units
from ..simd import F32Ptr
from .forms import PART_SLOT, STAGED_UNITS
from .plan import plan_units
from .softmax import LOG2E
from .unit import Merge, Unit, attend_unit, merge_parts


def flash_attention[Coll: KVCollectionT, q_dtype: DType, target: StaticString](
    coll: Coll,
    output: Ptr[q_dtype],  # [total_tokens, n_q, D]
    q: Ptr[q_dtype],  # [total_tokens, n_q, D]
    offsets: U32Ptr,  # [batch_size + 1]
    total_tokens: Int,
    n_q: Int,
    layer_idx: Int,
    scale: Float32,
    window: Int,  # keys a query reads, itself included (a sliding window); 0: every key before it
    sinks: F32Ptr,  # [n_sinks]: each query head's sink logit (GPT-OSS's); none when n_sinks is 0
    n_sinks: Int,  # 0 or n_q
    ctx: DeviceContext,
) raises:
    """Generic body of `mokv.flash_attention.ragged.*` on the CPU (a GPU runs MAX's
    attention kernel instead: kernels/max_kernels.mojo). An attention sink adds
    e^sink to a head's softmax denominator (a logit no value goes with)."""
    comptime assert is_cpu[target](), "mokv's attention kernel runs on the CPU; the ops take MAX's on a GPU"
    comptime Cache = Coll.CacheType
    comptime H = Cache.kv_params.num_heads
    comptime D = Cache.kv_params.head_size
    var kc = coll.get_key_cache(layer_idx)
    var vc = coll.get_value_cache(layer_idx)
    var batch_size = coll.batch_size()
    var group = n_q // H

    # Each head's sink in the scores' log2 units; none is -inf (it adds 2^-inf = 0).
    var sink_list = List[Float32](capacity=n_q)
    for h in range(n_q):
        sink_list.append(sinks[unsafe_offset=h] * LOG2E if n_sinks else Float32.MIN)
    var sink_log2 = sink_list.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

    var units = List[Unit]()
    var merges = List[Merge]()
    var n_parts = plan_units(kc, offsets, batch_size, group, window, units, merges)
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
        imm group, imm n_q, imm scale, imm window, imm sink_log2, imm parts
    }:
        var u = unit_ptr[unsafe_offset=i]
        attend_unit(kc, vc, q, output, u, group, n_q, scale, window, sink_log2, parts)
        if u.merge >= 0 and Atomic[Int64].fetch_add(pending_ptr.unsafe_offset(u.merge), -1) == 1:
            merge_parts[q_dtype, D, STAGED_UNITS[Cache.dtype, D]](merge_ptr[unsafe_offset=u.merge], parts, output, group, n_q, sink_log2)

    parallel_units(body, len(units), ctx)
    _ = pending^
    _ = units^  # keep the tables and partial states alive until every task has run
    _ = merges^
    _ = scratch^
    _ = sink_list^
