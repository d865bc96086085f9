"""Decode's score and P V forms in every variant the CPU choice can pick, on any CPU.

`NARROW_LANES` (8 or 16), `ROW_PAIR_SCORES`, `BF16_PV_DOT` and `SPLIT_PV` are chosen by
the building CPU (attention/forms.mojo), so the attention tests over a graph only run this
machine's variant. (With 8 lanes, MOKV_CPU_PORTABLE or AVX2, the 16-lane forms are skipped.)
Here `_qk_narrow` runs with 8 and 16 lanes and `_qk_row_pairs` (bf16) for 4 and 8 rows
per head, `qk_block` and `qk_heads` over f32 and FP8 keys, and `_pv_block` with and
without `dot_bf16` and split widening (and over FP8 values, widened to bf16 for
`dot_bf16`: `widen_bf16`, checked on every byte), against sums
taken in Float64. Every input is a multiple of 1/64 below 1
in magnitude, exact in bf16, so products and their f32 sums are exact and the
results must match to the bit. FP8 (e4m3fn) K and V are multiples of 1/8 below 1, a
third of them times 2^-6 (subnormals), with a power-of-two scale per key row
(`widened_scale`), exact as well.
"""

from std.sys.info import size_of
from std.memory import bitcast
from std.testing import assert_equal, assert_true, TestSuite

from mokv.continuous import ContinuousBatchingKVCache
from mokv.kernels.attention.forms import BF16_DOT, BK, KB, MAX_ROWS, NARROW_KEYS, O_NATURAL, O_PAIRED, O_SPLIT, RB
from mokv.kernels.attention.pv import o_natural, pv_block
from mokv.kernels.attention.scores import qk_block, qk_heads
from mokv.kernels.attention.scores_group import (
    ROW_PAIR_KEYS,
    qk_narrow,
    qk_row_pairs,
    store_narrow_q,
    store_row_pairs_q,
)
from mokv.kernels.cpu import HAS_AVX512_BF16, VECTOR_REGISTERS, W
from mokv.kernels.fp8 import widened_scale
from mokv.kernels.simd import F32Ptr, widen_bf16
from mokv.types import Ptr, is_quantized

comptime H = 4  # KV heads of a token: K rows of one head are H * D elements apart
comptime D = 128


def _value(i: Int, salt: Int) -> Float32:
    """A fixed pseudo-random multiple of 1/64 in (-1, 1)."""
    return Float32((i * 7919 + salt * 104729) % 127 - 63) / 64


def _cached[dtype: DType](i: Int, salt: Int) -> Scalar[dtype]:
    """A cached K or V element: `_value`, or in FP8 a multiple of 1/8 in (-1, 1)
    (e4m3fn has 3 mantissa bits), every third one times 2^-6: a subnormal e4m3fn."""
    comptime if is_quantized[dtype]():
        var tiny = Float32(1) / 64 if i % 3 == 0 else Float32(1)
        return (Float32((i * 7919 + salt * 104729) % 15 - 7) / 8 * tiny).cast[dtype]()
    return _value(i, salt).cast[dtype]()


def _row_scales[dtype: DType](n: Int) -> List[Float32]:
    """[n keys, H heads] (one scale per head of 128 lanes): 2^((j + h) % 3 - 8) in FP8,
    else 1 (unused)."""
    var scales = List[Float32](length=n * H, fill=1)
    comptime if is_quantized[dtype]():
        for j in range(n):
            for h in range(H):
                scales[j * H + h] = Float32(1 << ((j + h) % 3)) / 256
    return scales^


def _dot[dtype: DType](k: List[Scalar[dtype]], ks: List[Float32], j: Int, r: Int, h: Int) -> Float64:
    """Query row r (`_value(r * D + d, 6)`) . key j of head h (dequantized: times its
    scale), in Float64."""
    var sum: Float64 = 0
    for d in range(D):
        var kd = k[j * H * D + h * D + d].cast[DType.float64]() * Float64(ks[j * H + h])
        sum += Float64(_value(r * D + d, 6)) * kd
    return sum


def _check_block_and_heads[dtype: DType]() raises:
    """`qk_block` (4 rows x KB keys: decode over FP8, a few new tokens otherwise) on
    a full and a partial block of head 1, and `qk_heads` (one row per head, GQA 1) on
    each key, against Float64 sums of the dequantized keys."""
    comptime Cache = ContinuousBatchingKVCache[dtype, H, D]
    comptime STRIDE = Cache.token_stride()
    comptime n = KB + 1  # the second block is partial: it repeats key n - 1
    var k = List[Scalar[dtype]](length=n * STRIDE, fill=0)
    for i in range(len(k)):
        k[i] = _cached[dtype](i, 5)
    var ks = _row_scales[dtype](n)
    var q = List[Float32](length=MAX_ROWS * D, fill=0)  # [rows, D], in bf16 where BF16_DOT
    var qp = q.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    for i in range(len(q)):
        comptime if BF16_DOT[dtype, D]:
            qp.unsafe_bitcast[BFloat16]().unsafe_store(i, _value(i, 6).cast[DType.bfloat16]())
        else:
            q[i] = _value(i, 6)
    var s = List[Float32](length=BK * MAX_ROWS, fill=0)
    var sp = s.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var kp = k.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var ksp = ks.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

    comptime h = 1
    for j0 in range(0, n, KB):
        qk_block[Cache](qp, sp, 0, kp.unsafe_offset(h * D), ksp.unsafe_offset(h), j0, n)
    for j in range(n):
        for r in range(RB):
            assert_equal(Float64(s[j * MAX_ROWS + r]), _dot(k, ks, j, r, h), String("qk_block key ", j, " row ", r))
    for j in range(n):
        qk_heads[Cache](qp, sp, 0, H, kp, kp, ksp, j)
        for hh in range(H):
            assert_equal(Float64(s[j * MAX_ROWS + hh]), _dot(k, ks, j, hh, hh), String("qk_heads key ", j, " head ", hh))
    _ = k^  # read through pointers: keep them alive until here
    _ = ks^
    _ = q^
    _ = s^


def _check_scores[dtype: DType, R: Int, V: Int, full: Bool, ROW_PAIRS: Bool = False]() raises:
    """`_qk_narrow` in V lanes, or (ROW_PAIRS) `_qk_row_pairs`."""
    comptime Cache = ContinuousBatchingKVCache[dtype, H, D]
    comptime STRIDE = Cache.token_stride()
    comptime NK = ROW_PAIR_KEYS if ROW_PAIRS else NARROW_KEYS[STRIDE * size_of[Scalar[dtype]]()]
    comptime DOT = BF16_DOT[dtype, D] and not ROW_PAIRS
    var n = NK if full else NK - 3  # a partial block repeats its last key
    var k = List[Scalar[dtype]](length=NK * STRIDE, fill=0)
    for i in range(len(k)):
        k[i] = _value(i, 1).cast[dtype]()
    var qt = List[Float32](length=R * D, fill=0)
    var qtp = qt.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    for r in range(R):
        comptime for c in range(0, D, W):
            var qv = SIMD[DType.float32, W](0)
            comptime for i in range(W):
                qv[i] = _value(r * D + c + i, 2)
            comptime if ROW_PAIRS:
                store_row_pairs_q[R](qtp, r, c, qv)
            else:
                store_narrow_q[R, DOT, V](qtp, r, c, qv)
    var s = List[Float32](length=BK * MAX_ROWS, fill=0)
    var kp = k.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var sp = s.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    comptime if ROW_PAIRS:
        qk_row_pairs[Cache, R, full](qtp, sp, 0, kp, kp, 0, n)
    else:
        qk_narrow[Cache, R, full, V](qtp, sp, 0, kp, kp, 0, n)
    for j in range(n):
        for r in range(R):
            var want: Float64 = 0
            for d in range(D):
                var kd = k[j * STRIDE + d].cast[DType.float64]()
                want += Float64(_value(r * D + d, 2)) * Float64(kd)
            var where = String("R ", R, " V ", V, " row pairs ", ROW_PAIRS, " key ", j, " row ", r)
            assert_equal(Float64(s[j * MAX_ROWS + r]), want, where)
    _ = k^  # the kernel read them through pointers: keep them alive until here
    _ = qt^


def _check_pv[dtype: DType, rb: Int, DOT: Bool, SPLIT: Bool = False]() raises:
    comptime STRIDE = H * D
    comptime n = 13  # odd: the paired form's last key pairs with a zero probability
    var v = List[Scalar[dtype]](length=n * STRIDE, fill=0)
    for i in range(len(v)):
        v[i] = _cached[dtype](i, 3)
    var vs = _row_scales[dtype](n)
    var vsp = vs.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var p = List[Float32](length=BK * MAX_ROWS, fill=0)
    var pp = p.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    for j in range(n):
        for r in range(rb):
            var pr = abs(_value(j * rb + r, 4))
            comptime if DOT:  # bf16 pairs (P[r, j], P[r, j + 1]) in one 32-bit slot
                var slot = (j // 2) * MAX_ROWS + r
                comptime if is_quantized[dtype]():  # times the key's V scale (`softmax_key_major`)
                    pr *= widened_scale[H](vsp, j)
                pp.unsafe_bitcast[BFloat16]().unsafe_store(slot * 2 + j % 2, pr.cast[DType.bfloat16]())
            else:
                pp.unsafe_store(j * MAX_ROWS + r, pr)
    var o = List[Float32](length=rb * D, fill=0)
    var op = o.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var vp = v.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    pv_block[dtype, D, STRIDE, rb, H, DOT, SPLIT](op, pp, 0, vp, vsp, n, vp, 0)
    comptime order = O_PAIRED if DOT else (O_SPLIT if SPLIT else O_NATURAL)
    for r in range(rb):
        comptime for c in range(0, D, W):
            var got = o_natural[D, order](op, r, c)
            comptime for i in range(W):
                var want: Float64 = 0
                for j in range(n):
                    var vd = v[j * STRIDE + c + i].cast[DType.float64]() * Float64(vs[j * H])
                    want += Float64(abs(_value(j * rb + r, 4))) * Float64(vd)
                var where = String("rb ", rb, " DOT ", DOT, " SPLIT ", SPLIT, " row ", r, " column ", c + i)
                assert_equal(Float64(got[i]), want, where)
    _ = o^  # read through pointers: keep them alive until here
    _ = p^
    _ = vs^


def test_scores_in_8_and_16_lanes() raises:
    comptime for V in [8, 16]:
        comptime if V <= W:  # the portable paths (W = 8) never take 16 lanes
            comptime for R in [4, 8]:
                _check_scores[DType.float32, R, V, True]()
                _check_scores[DType.float32, R, V, False]()
                _check_scores[DType.bfloat16, R, V, True]()
                _check_scores[DType.bfloat16, R, V, False]()


def test_scores_over_keys_widened_for_row_pairs() raises:
    comptime if W != 16:  # two rows of 8 lanes per vector: AVX-512 only
        return
    comptime for R in [4, 8]:
        _check_scores[DType.bfloat16, R, W, True, True]()
        _check_scores[DType.bfloat16, R, W, False, True]()


def test_block_and_head_scores_over_f32_and_fp8() raises:
    _check_block_and_heads[DType.float32]()
    _check_block_and_heads[DType.float8_e4m3fn]()


def test_pv_with_and_without_the_bf16_dot_product() raises:
    comptime for rb in [1, 4, 8]:
        _check_pv[DType.float32, rb, False]()
        _check_pv[DType.bfloat16, rb, False]()
        _check_pv[DType.float8_e4m3fn, rb, False]()
        comptime if VECTOR_REGISTERS >= 32:  # `SPLIT_PV`'s condition
            _check_pv[DType.bfloat16, rb, False, True]()
        comptime if HAS_AVX512_BF16:
            _check_pv[DType.bfloat16, rb, True]()
            _check_pv[DType.float8_e4m3fn, rb, True]()


def test_fp8_widens_to_bf16_exactly() raises:
    """`widen_bf16` (AVX-512 BF16) of every e4m3fn byte but the two NaNs, subnormals
    and zeros included, against Mojo's own e4m3fn -> f32 conversion over 256. The bf16
    values are normal (`vdpbf16ps` reads subnormals as zero): checked by their
    exponent field."""
    comptime if HAS_AVX512_BF16:
        var bytes = List[UInt8](length=256, fill=0)
        for i in range(256):
            bytes[i] = UInt8(i)
        var bp = bytes.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_bitcast[Scalar[DType.float8_e4m3fn]]()
        for c in range(0, 256, 2 * W):
            var got = widen_bf16(bp, c)
            var bits = bitcast[DType.uint16, 2 * W](got)
            for i in range(2 * W):
                var b = c + i
                if b & 0x7F == 0x7F:
                    continue
                var want = bp[unsafe_offset=b].cast[DType.float32]() / 256
                assert_equal(got[i].cast[DType.float32](), want, String("byte ", b))
                assert_true(want == 0 or (bits[i] >> 7) & 0xFF != 0, String("subnormal bf16 for byte ", b))
        _ = bytes^


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
