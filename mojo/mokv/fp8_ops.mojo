"""Graph-facing op of scaled FP8 pages on a GPU that no model graph calls: the
dequantize step of attention (kernels/fp8_gpu.mojo) on its own, so that the suite can
compare its bfloat16 scratch with the float64 reference on the CPU."""

from extensibility import register, InputTensor, OutputTensor
from max.gpu.host import DeviceContext

from .kernels.fp8_gpu import dequantize_pages
from .ops import _elems, _u32
from .paged import PagedKVCacheCollection


@register("mokv.dequantize_pages.ragged.paged")
struct DequantizePagesPaged:
    """Every lookup-table column of every batch entry, one scratch page each:
    scratch page b * max_num_pages + i holds page i of entry b, dequantized."""

    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, page_size: Int, //, target: StaticString](
        scratch: OutputTensor[dtype=DType.bfloat16, rank=6, ...],  # [batch_size * max_num_pages, 2, 1, page_size, H, D]
        table: OutputTensor[dtype=DType.uint32, rank=2, ...],  # [batch_size, max_num_pages]
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size + 1]
        collection: PagedKVCacheCollection[dtype_code, num_heads, head_size, page_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],  # [1], host
        ctx: DeviceContext,
    ) raises:
        dequantize_pages[target=target](
            collection,
            Int(layer_idx.unsafe_ptr()[unsafe_offset=0]),
            _u32(input_row_offsets.unsafe_ptr()),
            _elems(scratch.unsafe_ptr()),
            _u32(table.unsafe_ptr()),
            collection.max_num_pages,
            ctx,
        )
