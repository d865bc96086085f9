"""Prints what the CPU kernels read each e4m3fn byte as (mokv/kernels/simd.mojo `widen`,
times 256, the factor its callers fold into the scale): one line per byte 0-255, the
float32's bits in hex. tests/ops/test_fp8_pages.py compares them with the float64
reference (tests/fp8_reference.py) on every CPU path."""

from std.memory import bitcast

from mokv.kernels.cpu import W
from mokv.kernels.simd import E4M3FN_WIDENED, widen


def main():
    var bytes = List[UInt8](length=256, fill=0)
    for i in range(256):
        bytes[i] = UInt8(i)
    var p = bytes.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_bitcast[Scalar[DType.float8_e4m3fn]]()
    for i in range(0, 256, W):
        var x = widen(p, i) * (1 / E4M3FN_WIDENED)
        var bits = bitcast[DType.uint32, W](x)
        for k in range(W):
            print(hex(bits[k]))
    _ = bytes^
