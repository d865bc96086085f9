# A test-only op (tests/ops/test_fp8_pages.py): writes float32 values into a buffer of
# FP8 pages with Mojo's e4m3fn cast, then reads the pages back as float32 -- the cast
# mokv's kernels quantize with, on a page buffer of MAX's FP8 dtype, on the CPU.
from extensibility import register, InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext


@register("test_fp8_page_roundtrip")
struct TestFp8PageRoundtrip:
    @staticmethod
    def execute[target: StaticString](
        read_back: OutputTensor[dtype=DType.float32, rank=1, ...],
        pages: MutableInputTensor[dtype=DType.float8_e4m3fn, rank=1, ...],
        values: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        for i in range(values.dim_size(0)):
            pages[i] = values[i].cast[DType.float8_e4m3fn]()
        for i in range(values.dim_size(0)):
            read_back[i] = pages[i].cast[DType.float32]()
