"""Unscaled FP8 (e4m3fn) pages on a GPU: MAX 26.7's `--kv-cache-format float8_e4m3fn`
cache, one byte per value and no scales (docs/quantized.md, "Unscaled FP8 pages").

On a GPU an FP8 collection is always this format: the scaled pages' constructors are
CPU-only (ops.mojo), and the unscaled ones refuse the CPU, whose kernels read scales.

Writes cast each value to e4m3fn saturated at +-448, as MAX's kernels do. Mojo's cast
saturates on the CPU (448 for 465, 1e6 and inf; NaN stays NaN) and on sm_90 it is PTX's
`cvt.rn.satfinite.e4m3x2.f32`, which saturates too (2026-11-28); on AMD it was not
looked at, so `saturated` clamps first: two compares per value, and the stored byte is
448's or -448's on every target.

Reads are MAX's attention kernel on its native FP8 path, the only one that reads FP8
pages: Q, K and V float8_e4m3fn and a bfloat16 output, on sm_100-class (Blackwell) or
AMD GPUs only (nn/attention/gpu/mha.mojo: no MHA of MAX 26.7 reads FP8 pages on sm_90,
with queries of any dtype). `cast_on_gpu` makes the e4m3fn queries and casts the
bfloat16 output back to the op's dtype.
"""

from std.math import ceildiv

from max.gpu import block_idx, thread_idx
from max.gpu.host import DeviceContext

from ..types import Ptr
from .fp8 import E4M3FN_MAX


@always_inline
def saturated[dtype: DType, src_dtype: DType](x: Scalar[src_dtype]) -> Scalar[dtype]:
    """`x` cast to `dtype`; to e4m3fn, clamped to +-448 first (NaN stays NaN: both
    compares are false)."""
    comptime if dtype == DType.float8_e4m3fn:
        var f = x.cast[DType.float32]()
        var clamped = E4M3FN_MAX if f > E4M3FN_MAX else (-E4M3FN_MAX if f < -E4M3FN_MAX else f)
        return clamped.cast[dtype]()
    else:
        return x.cast[dtype]()


def cast_on_gpu[dst_dtype: DType, src_dtype: DType](dst: Ptr[dst_dtype], src: Ptr[src_dtype], n: Int, ctx: DeviceContext) raises:
    """Enqueues `dst[i] = saturated(src[i])` for the `n` elements (one thread each)."""
    comptime BLOCK = 256
    var count = Int64(n)  # a kernel cannot capture an Int here ("Int ... do not conform to DevicePassable")

    def kernel() {var dst, var src, var count}:
        var i = Int(block_idx.x) * BLOCK + Int(thread_idx.x)
        if i < Int(count):
            dst.unsafe_store(i, saturated[dst_dtype](src.unsafe_load(i)))

    if n > 0:
        ctx.enqueue_function(kernel, grid_dim=ceildiv(n, BLOCK), block_dim=BLOCK)
