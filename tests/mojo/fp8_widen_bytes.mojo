"""Prints what the CPU kernels read each e4m3fn byte as (mokv/kernels/simd.mojo `widen`,
times 256, the factor its callers fold into the scale): one line per byte 0-255, the
float32's bits in hex; where the kernels have AVX-512 BF16, 256 more lines for
`widen_bf16` (the bf16 widened to float32, times 256). tests/ops/test_fp8_pages.py
compares them with the float64 reference (tests/fp8_reference.py) on every CPU path."""

from std.memory import bitcast

from mokv.kernels.cpu import HAS_AVX512_BF16, W
from mokv.kernels.simd import E4M3FN_WIDENED, widen, widen_bf16


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
    comptime if HAS_AVX512_BF16:
        for i in range(0, 256, 2 * W):
            var x = widen_bf16(p, i).cast[DType.float32]() * (1 / E4M3FN_WIDENED)
            var bits = bitcast[DType.uint32, 2 * W](x)
            for k in range(2 * W):
                print(hex(bits[k]))
    _ = bytes^
