"""The CPU attention's tile sizes, and the score and P V forms it takes on the build
target (from kernels/cpu.mojo's features and tuning table): one place, so that a
kernel file never tests a feature itself."""

from ...types import SCALE_BLOCK, is_quantized, scales_per_head
from ..cpu import HALF_RATE_BF16_DOT, HAS_AVX512_BF16, SPLIT_512_UNITS, VECTOR_REGISTERS, W

comptime I32Ptr = Pointer[Int32, MutUntrackedOrigin]
comptime BK = 64  # most keys per tile (the row stride of the score tile)
comptime MAX_ROWS = 64  # query rows (tokens x group heads) per unit: K/V tiles are loaded once per unit
comptime RB = 4  # rows per register block (rows are padded to a multiple of RB)
comptime KB = W // RB  # keys per QK register block: RB * KB = W accumulators
comptime NARROW_KEYS[stride_bytes: Int] = min(W, 16 if stride_bytes <= 2048 else 8)
"""Keys per `qk_narrow` block (one accumulator each) for K rows `stride_bytes`
apart. The block reads its keys' rows side by side, a cache line of each at a time;
rows a multiple of 4 KiB apart share one L1 set, and 16 such lines overflow its 12 ways.
The block's loop over L1-resident f32 rows: 16 keys ran at 96 GFLOP/s with 2 KiB
strides and 27 with 4, 8 or 16 KiB; 8 keys at 85-96 for all four. At most W: with 16
registers (the portable paths) 16 accumulators would spill."""
comptime NARROW_LANES = 8 if SPLIT_512_UNITS else W
"""Lanes of `qk_narrow`'s vectors. Where 512-bit ops run as two halves (Zen 4), 8
lanes cost no peak, and 16 were slower (bf16 GQA 8, one thread in L2: 55.8 -> 58.5
us). CPUs with whole 512-bit units run 16 lanes at twice the rate of 8: there, against
8 lanes (emeraldrapids, `ab_decode.py`, 1 x 16k unless said, three rounds), bf16 GQA 8
3.25 -> 2.34 ms, 4 x 8k 6.43 -> 4.46 ms, bf16 GQA 4 3.53 -> 2.55 ms, f32 GQA 8
x0.87-0.91, f32 GQA 4 x0.97."""
comptime PART_SLOT[D: Int] = MAX_ROWS * (D + 2)
"""Floats of one partial softmax state: o [MAX_ROWS, D], then m and l [MAX_ROWS]."""
comptime BF16_DOT[dtype: DType, D: Int] = (
    HAS_AVX512_BF16 and D % (2 * W) == 0 and (dtype == DType.bfloat16 or (is_quantized[dtype]() and D == SCALE_BLOCK))
)
"""Whether decode scores over a `dtype` cache use `dot_bf16`: Q is then rounded to
bf16 once per query (see flash_attention.mojo). bf16 K is read as stored; FP8 K (one
scale per head) is widened to bf16 in registers, exactly (`simd.widen_bf16`)."""
comptime BF16_PV_DOT[dtype: DType, D: Int] = BF16_DOT[dtype, D] and not HALF_RATE_BF16_DOT
"""Whether decode P V over a `dtype` cache uses `dot_bf16` as well (P then rounded to
bf16 once per tile; over FP8, P times each key's V scale: `softmax_key_major`). Where `vdpbf16ps` runs at half rate, P V widens each V chunk to
f32 once and feeds it to the FMAs of all the head's rows instead: emeraldrapids,
against `dot_bf16` P V (1 x 16k unless said, three rounds): bf16 GQA 8 2.32 -> 1.97 ms,
4 x 8k 4.35 -> 3.74 ms, GQA 4 x0.90, GQA 1 x0.93."""
comptime SPLIT_PV[dtype: DType, D: Int] = (
    dtype == DType.bfloat16 and not BF16_PV_DOT[dtype, D] and D % (2 * W) == 0 and VECTOR_REGISTERS >= 32
)
"""Whether decode P V over a bf16 cache widens V in split order: 2W bf16 columns are
loaded as W 32-bit words, and a shift and a mask make the even columns and the odd
ones into two f32 vectors (one op per W columns instead of two for a zero-extension
and a shift). O's columns are then kept even-then-odd per 2W (`O_SPLIT`) until the
unit's output. emeraldrapids, bf16 GQA 8 with `qk_row_pairs`, direct calls
(`decode_direct.mojo`, alternating): two threads at 1 x 16k 1.44-1.46 -> 1.39 ms, one
thread in L2 (768 keys) 118-120 -> 112 us; GQA 1 in L2 38.6 -> 36.7 us. Only with 32
registers: a GQA 8 head's block takes two column chunks (the pair a split makes), 16
accumulators, all the registers of the portable paths."""
comptime ROW_PAIR_SCORES[dtype: DType, D: Int] = HALF_RATE_BF16_DOT and dtype == DType.bfloat16 and D % W == 0
"""Whether GQA 8 and 4 decode scores over a `dtype` cache are f32 FMAs over K widened
in registers (`qk_row_pairs`) rather than `vdpbf16ps` (`qk_narrow`): where that
instruction runs at half the FMA's rate."""
comptime O_NATURAL = 0
"""O's columns as in the output (prefill units, f32 decode units)."""
comptime O_PAIRED = 1
"""O's columns in the order of `dot_bf16` P V (`pv.pair_keys_mask`)."""
comptime O_SPLIT = 2
"""O's columns even then odd per 2W (`SPLIT_PV`)."""
comptime DECODE_O_ORDER[dtype: DType, D: Int] = O_PAIRED if BF16_PV_DOT[dtype, D] else (
    O_SPLIT if SPLIT_PV[dtype, D] else O_NATURAL
)
"""The column order decode units keep O in; prefill units keep it natural."""
comptime STAGED_UNITS[dtype: DType, D: Int] = is_quantized[dtype]() and scales_per_head[D]() > 1
"""Whether every unit over a `dtype` cache stages its K and V tiles as f32 and takes the
prefill forms, decode units included: FP8 heads of more than one scale block (256
lanes and up). The decode forms read FP8 bytes where a head has one scale (128
lanes), folding it into each key's scores and probabilities; a key's two blocks'
scales would need two partial dot products per key instead."""
