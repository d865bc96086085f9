"""The softmax's polynomial 2^x (mokv/kernels/simd.mojo `exp2`) against float64 exp."""

from std.math import exp
from std.testing import assert_equal, assert_true, TestSuite

from mokv.kernels.cpu import W
from mokv.kernels.simd import exp2


def _max_rel_error[degree: Int](lo: Float64, hi: Float64, n: Int) -> Float64:
    """Largest |exp2(x) / 2^x - 1| over n points of [lo, hi], 2^x from float64 exp."""
    var worst: Float64 = 0
    for i in range(0, n, W):
        var x = SIMD[DType.float32, W](0)
        comptime for k in range(W):
            x[k] = Float32(lo + (hi - lo) * Float64(min(i + k, n - 1)) / Float64(n - 1))
        var y = exp2[degree](x)
        comptime for k in range(W):
            var want = exp(Float64(x[k]) * 0.6931471805599453)
            worst = max(worst, abs(Float64(y[k]) / want - 1))
    return worst


def test_degree_5_is_float32_accurate() raises:
    var err = _max_rel_error[5](-120, 8, 100003)
    assert_true(err < 3e-7, String("degree 5 relative error ", err))


def test_degree_3_is_far_below_bf16_spacing() raises:
    var err = _max_rel_error[3](-120, 8, 100003)
    assert_true(err < 8e-5, String("degree 3 relative error ", err))


def test_masked_scores_give_exact_zeros() raises:
    # Masked scores are Float32.MIN; x far below -149 must give 0, never NaN.
    var x = SIMD[DType.float32, W](Float32.MIN) - 50
    x[1] = -1e30
    x[2] = -200
    x[3] = -151
    var y = exp2[5](x)
    for k in range(W):
        assert_equal(y[k], 0, String("lane ", k))
    assert_equal(exp2[3](SIMD[DType.float32, W](0))[0], exp2[3](SIMD[DType.float32, W](-0.0))[0])


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
