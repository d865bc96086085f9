"""A float64 reference of FP8 (e4m3fn) pages with per-block scales, written by hand:
numpy has no e4m3fn type (and ml_dtypes is not a dependency), so the rounding is spelled
out here, independent of MAX's and mokv's kernels.

e4m3fn: 1 sign, 4 exponent (bias 7) and 3 mantissa bits; no infinities; the largest
finite value is 448 = 1.75 * 2**8, the smallest normal 2**-6, subnormals step by 2**-9.
A cast rounds to nearest, ties to even, and saturates at +-448 (Mojo 1.2's cast and
MAX's `cast_saturating` on the store both do).

A block of `granularity` lanes (one token, one head) is stored as

    scale = float32(absmax(block)) / 448          (float32)
    q     = e4m3fn(float32(x / scale))
    read  = q * scale

and a block of zeros has scale 0 and reads back zeros.
"""

from __future__ import annotations

import numpy as np

E4M3FN_MAX = 448.0
E4M3FN_MIN_NORMAL_EXP = -6
E4M3FN_MANTISSA_BITS = 3


def round_e4m3fn(x: np.ndarray) -> np.ndarray:
    """`x` (any float dtype) rounded to the nearest e4m3fn value, ties to even,
    saturated at +-448; NaN stays NaN. Returns float64."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        # The exponent of each value's leading bit, floored at the normal range's: below
        # it the subnormals share one step.
        _, e = np.frexp(a)
        exp = np.maximum(e - 1, E4M3FN_MIN_NORMAL_EXP)
        step = np.ldexp(1.0, exp - E4M3FN_MANTISSA_BITS)
        q = np.round(a / step) * step  # np.round: half to even; exact in float64
    q = np.where(a >= E4M3FN_MAX, E4M3FN_MAX, q)
    q = np.where(a == 0, 0.0, q)
    return np.where(np.isnan(x), np.nan, np.copysign(q, x))


def decode_e4m3fn(bits: np.ndarray) -> np.ndarray:
    """The float64 values of e4m3fn bytes (sign, 4 exponent bits of bias 7, 3 mantissa;
    exponent 15 with mantissa 7 is NaN)."""
    bits = np.asarray(bits).astype(np.int64)
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    mag = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    return np.where(bits & 0x80, -mag, mag)


def quantize_blocks(x: np.ndarray, granularity: int) -> tuple[np.ndarray, np.ndarray]:
    """`x [..., head_dim]` (float32 values) as FP8 values (float64 holding e4m3fn
    values) and float32 scales `[..., head_dim // granularity]`."""
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // granularity, granularity)
    absmax = np.abs(blocks).max(axis=-1)
    scale = (absmax / np.float32(E4M3FN_MAX)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    q = round_e4m3fn((blocks / safe).astype(np.float32))
    return q.reshape(x.shape), scale


def dequantize_blocks(q: np.ndarray, scale: np.ndarray, granularity: int) -> np.ndarray:
    """What a kernel reads back: `q * scale` per block, in float64."""
    q = np.asarray(q, dtype=np.float64)
    blocks = q.reshape(*q.shape[:-1], q.shape[-1] // granularity, granularity)
    return (blocks * np.asarray(scale, np.float64)[..., None]).reshape(q.shape)
