"""SIMD helpers shared by the CPU kernels: float32 vectors of `W` lanes (kernels/cpu.mojo)."""

from std.memory import bitcast
from std.sys import llvm_intrinsic
from std.utils.index import IndexList

from ..types import Ptr
from .cpu import HAS_AVX512_BF16, HAS_AVX512F, W

comptime F32Ptr = Pointer[Float32, MutUntrackedOrigin]


comptime E4M3FN_WIDENED: Float32 = 1.0 / 256
"""What `widen` multiplies an e4m3fn value by: its callers fold the 256 back into the
value's scale (a power of two, so exactly)."""


@always_inline
def widen[dtype: DType, width: Int = W](p: Ptr[dtype], off: Int) -> SIMD[DType.float32, width]:
    """Loads `width` elements as f32. bf16 widens by a 16-bit shift of the bits (exact,
    and much cheaper than the generic conversion LLVM emits for `cast`).

    e4m3fn (an FP8 cache's values) widens to q / 256 (`E4M3FN_WIDENED`), exactly: the
    byte's sign, exponent and mantissa moved into a float16's fields (its 7 low bits
    shifted up by 7 under its sign) make a float16 of value q * 2^-8 (e4m3fn's exponent
    bias is 7, float16's 15; a subnormal, exponent 0, maps to a float16 subnormal with
    the same ratio), which widens in hardware (`vcvtph2ps`) instead of through the
    generic e4m3fn conversion. The move is three ops per vector: the byte sign-extended
    to 16 bits, shifted left by 7 (the sign's copies land in bits 14 and 15) and masked
    to bit 15 and bits 7-13. The NaN bytes 0x7F / 0xFF would widen to 480 / 256 and
    -480 / 256; the quantize saturates at 448, so no page holds them."""
    comptime if dtype == DType.bfloat16:
        var bits = p.unsafe_bitcast[UInt16]().unsafe_load[width=width](off).cast[DType.uint32]() << 16
        return SIMD[DType.float32, width](from_bits=bits)
    elif dtype == DType.float8_e4m3fn:
        var wide = p.unsafe_bitcast[Int8]().unsafe_load[width=width](off).cast[DType.int16]()
        var half = (bitcast[DType.uint16, width](wide) << 7) & 0xBF80
        return SIMD[DType.float16, width](from_bits=half).cast[DType.float32]()
    else:
        return p.unsafe_load[width=width](off).cast[DType.float32]()


def _e4m3fn_subnormals_bf16() -> SIMD[DType.uint16, 32]:
    """bf16 bits of m * 2^-17 (an e4m3fn subnormal, m * 2^-9, over 256) at index m < 8;
    `widen_bf16` looks them up by the byte's low 5 bits (the rest never looked up)."""
    var t = SIMD[DType.uint16, 32](0)
    t[1] = 0x3700  # 2^-17
    t[2] = 0x3780  # 2^-16
    t[3] = 0x37C0  # 1.5 * 2^-16
    t[4] = 0x3800  # 2^-15
    t[5] = 0x3820
    t[6] = 0x3840
    t[7] = 0x3860  # 1.75 * 2^-15
    return t


@always_inline
def widen_bf16[dtype: DType](p: Ptr[dtype], off: Int) -> SIMD[DType.bfloat16, 2 * W]:
    """Loads 2W e4m3fn bytes as bf16 of value q / 256 (`E4M3FN_WIDENED`, as `widen`),
    exactly, for `dot_bf16`: e4m3fn has 4 exponent bits and 3 mantissa bits, bf16 8
    and 7. A normal byte's exponent and mantissa move into bf16's fields (shifted left
    by 4, the exponent raised by 112 = 127 - 7 - 8); a subnormal one (exponent 0:
    m * 2^-9, zero included) becomes a normal bf16 from a table of its 8 values, since
    `vdpbf16ps` reads bf16 subnormals as zero; the sign is bit 7's. Seven ops per 2W
    bytes (sign extension, shift, test, table permute, blend, two logic ops), where
    `widen` takes eight per 2W to float32 (four per W). The NaN bytes 0x7F / 0xFF read
    as +-480 / 256, as with `widen` (no page holds them: the quantize saturates)."""
    comptime assert dtype == DType.float8_e4m3fn, "widen_bf16 reads e4m3fn bytes"
    comptime assert HAS_AVX512_BF16 and W == 16, "for `dot_bf16`: AVX-512 (vpermw)"
    var wide = p.unsafe_bitcast[Int8]().unsafe_load[width=2 * W](off).cast[DType.int16]()
    var word = bitcast[DType.uint16, 2 * W](wide)
    var normal = ((word << 4) & 0x07F0) | 0x3800
    comptime table = _e4m3fn_subnormals_bf16()
    var sub = llvm_intrinsic["llvm.x86.avx512.permvar.hi.512", SIMD[DType.uint16, 2 * W]](table, word)
    var magnitude = (word & 0x78).eq(0).select(sub, normal)
    return bitcast[DType.bfloat16, 2 * W](magnitude | (word & 0x8000))


@always_inline
def widen_even[width: Int = W](words: SIMD[DType.uint32, width]) -> SIMD[DType.float32, width]:
    """The even bf16 of `words` (pairs of bf16 loaded as 32-bit words) as f32: a shift.
    With `widen_odd`, one op per `width` elements, against two (zero-extension and
    shift) for `widen`; the elements come out split, even ones and odd ones apart, so
    the other operand must be in the same order."""
    return SIMD[DType.float32, width](from_bits=words << 16)


@always_inline
def widen_odd[width: Int = W](words: SIMD[DType.uint32, width]) -> SIMD[DType.float32, width]:
    """The odd bf16 of `words` as f32: a mask (see `widen_even`)."""
    return SIMD[DType.float32, width](from_bits=words & UInt32(0xFFFF0000))


@always_inline
def dot_bf16[width: Int = W](
    acc: SIMD[DType.float32, width], a: SIMD[DType.bfloat16, 2 * width], b: SIMD[DType.bfloat16, 2 * width]
) -> SIMD[DType.float32, width]:
    """Returns acc[i] + a[2i] b[2i] + a[2i+1] b[2i+1] (`vdpbf16ps`): 2 x `width` bf16
    products into `width` f32 lanes per instruction (16 or 8), twice the elements of an
    f32 FMA, with no widening of a or b. Only where HAS_AVX512_BF16."""
    comptime assert HAS_AVX512_BF16, "vdpbf16ps needs AVX-512 BF16 (kernels/cpu.mojo)"
    comptime assert width == W or width == W // 2, "vdpbf16ps has 512- and 256-bit forms"
    comptime name = "llvm.x86.avx512bf16.dpbf16ps.512" if width == W else "llvm.x86.avx512bf16.dpbf16ps.256"
    return llvm_intrinsic[name, SIMD[DType.float32, width]](acc, a, b)


def _exp2_coefficients[degree: Int]() -> List[Float32]:
    """Near-minimax polynomials for 2^f on [-0.5, 0.5] (Lawson-weighted least squares):
    largest relative error 7.5e-5 for degree 3, 2.3e-7 for degree 5 (float32 Horner)."""
    comptime assert degree == 3 or degree == 5, "exp2 polynomials of degree 3 and 5"
    comptime if degree == 3:
        return [0.99992806, 0.69326097, 0.24261113, 0.055171665]
    return [1.0000001, 0.69314694, 0.2402212, 0.055507131, 0.0096755410, 0.0013276471]


@always_inline
def exp2[degree: Int](x: SIMD[DType.float32, W]) -> SIMD[DType.float32, W]:
    """2^x, for the softmax's x <= 0 (-inf included): 2^round(x) x p(x - round(x)) with
    a `degree` polynomial p. Degree 3 is for probabilities that are rounded to bf16
    next (its 7.5e-5 is far below bf16's 3.9e-3 spacing), 5 for float32 ones. Against
    the standard library's `exp` (14 instructions, 9 of them FMAs) it takes 4 + degree.
    The power of two is `vscalefps` with AVX-512F; elsewhere its exponent bits are
    built with integer ops, the same value for every x >= -126 and 0 below (where
    `vscalefps` gives subnormals under 1.2e-38, noise to a softmax sum of at least 1)."""
    var xc = max(x, SIMD[DType.float32, W](-200))  # 2^-200 is 0 in float32; -inf would make f NaN
    var n = llvm_intrinsic["llvm.roundeven", SIMD[DType.float32, W]](xc)
    var f = xc - n
    comptime top = _exp2_coefficients[degree]()[degree]
    var p = SIMD[DType.float32, W](top)
    comptime for k in range(degree - 1, -1, -1):
        comptime ck = _exp2_coefficients[degree]()[k]
        p = p.fma(f, SIMD[DType.float32, W](ck))
    comptime if HAS_AVX512F:
        return llvm_intrinsic["llvm.x86.avx512.mask.scalef.ps.512", SIMD[DType.float32, W]](
            p, n, SIMD[DType.float32, W](0), Int16(-1), Int32(4)
        )
    else:
        return p * pow2_int(n)


@always_inline
def pow2_int(n: SIMD[DType.float32, W]) -> SIMD[DType.float32, W]:
    """2^n for whole n (as floats): the exponent field (n + 127) << 23 for
    -126 <= n <= 127, 0 below (a biased exponent of 0 with a zero mantissa), and
    2^127 above (the softmax never asks for more than 2^LAZY_MAX)."""
    var e = min(max(n.cast[DType.int32]() + 127, 0), 254)
    return SIMD[DType.float32, W](from_bits=(e << 23).cast[DType.uint32]())


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
def _fold_level[s: Int, n: Int](x: Array[SIMD[DType.float32, W], n]) -> Array[SIMD[DType.float32, W], n // 2]:
    """One butterfly level over n vectors of partial sums of s lanes: n // 2 vectors."""
    var y = Array[SIMD[DType.float32, W], n // 2](fill=0)
    comptime for i in range(n // 2):
        y[i] = _fold[s](x[2 * i], x[2 * i + 1])
    return y^


@always_inline
def _fold_all[s: Int, n: Int](x: Array[SIMD[DType.float32, W], n]) -> SIMD[DType.float32, W]:
    comptime if n == 1:
        return x[0]
    else:
        return _fold_all[s // 2, n // 2](_fold_level[s, n](x))


@always_inline
def lane_sums(acc: Array[SIMD[DType.float32, W], W]) -> SIMD[DType.float32, W]:
    """Lane i of the result = acc[i].reduce_add(). A butterfly of W - 1 two-source
    shuffles pairs and adds, about 3 instructions per sum instead of log2(W) + 4 for a
    `reduce_add` each."""
    return _fold_all[W, W](acc)
