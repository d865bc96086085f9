"""Graph-facing MLA ops: the `@register` structs of an MLA cache's kernels
(mojo/mokv/kernels/attention/mla_*.mojo). They take the cache's flat tensors, as MAX's
MLA ops do, and build the `LatentPages` view inside.

    blocks         dtype   [total_num_pages, 1, num_layers, page_size, 1, row_size]
    cache_lengths  uint32  [batch_size]
    lookup_table   uint32  [batch_size, max_num_pages]
    layer_idx      uint32  [1], host
"""

from extensibility import register, InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from std.utils.index import IndexList

from .kernels.attention.mla_attention import mla_attention
from .kernels.attention.mla_pages import LatentPages, mla_store
from .ops import _elems, _u32


def _pages[dtype: DType, origin: Origin, //](
    blocks: Pointer[Scalar[dtype], origin],
    blocks_dims: IndexList[6],
    cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
    lookup_table: InputTensor[dtype=DType.uint32, rank=2, ...],
    layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
) -> LatentPages[dtype]:
    return LatentPages[dtype](
        _elems(blocks),
        _u32(cache_lengths.unsafe_ptr()),
        _u32(lookup_table.unsafe_ptr()),
        lookup_table.dim_size(1),
        blocks_dims[2],
        blocks_dims[3],
        blocks_dims[5],
        Int(layer_idx.unsafe_ptr()[unsafe_offset=0]),
    )


@register("mokv.mla_store.ragged.paged")
struct MLAStorePaged:
    @staticmethod
    def execute[target: StaticString](
        blocks: MutableInputTensor[rank=6, ...],  # [pages, 1, layers, page_size, 1, row_size]
        latent: InputTensor[rank=2, ...],  # [total_tokens, latent_dim]
        k_rope: InputTensor[dtype=latent.dtype, rank=2, ...],  # [total_tokens, rope_dim]
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size + 1]
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size]
        lookup_table: InputTensor[dtype=DType.uint32, rank=2, ...],  # [batch_size, max_num_pages]
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],  # [1], host
        ctx: DeviceContext,
    ) raises:
        var dims = IndexList[6](
            blocks.dim_size(0), blocks.dim_size(1), blocks.dim_size(2),
            blocks.dim_size(3), blocks.dim_size(4), blocks.dim_size(5),
        )
        mla_store[target=target](
            _pages(blocks.unsafe_ptr(), dims, cache_lengths, lookup_table, layer_idx),
            _elems(latent.unsafe_ptr()),
            _elems(k_rope.unsafe_ptr()),
            _u32(input_row_offsets.unsafe_ptr()),
            cache_lengths.dim_size(0),
            latent.dim_size(0),
            latent.dim_size(1),
            ctx,
        )


@register("mokv.mla_attention.ragged.paged")
struct MLAAttentionPaged:
    @staticmethod
    def execute[target: StaticString](
        output: OutputTensor[rank=3, ...],  # [total_tokens, num_heads, latent_dim]
        q: InputTensor[dtype=output.dtype, rank=3, ...],  # [total_tokens, num_heads, row_size]
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size + 1]
        blocks: MutableInputTensor[rank=6, ...],  # [pages, 1, layers, page_size, 1, row_size]
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size]
        lookup_table: InputTensor[dtype=DType.uint32, rank=2, ...],  # [batch_size, max_num_pages]
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],  # [1], host
        scale: InputTensor[dtype=DType.float32, rank=1, ...],  # [1], host
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "on a GPU, mokv's MLA attention is MAX's (mokv.ops.mla)"
        var dims = IndexList[6](
            blocks.dim_size(0), blocks.dim_size(1), blocks.dim_size(2),
            blocks.dim_size(3), blocks.dim_size(4), blocks.dim_size(5),
        )
        mla_attention(
            _pages(blocks.unsafe_ptr(), dims, cache_lengths, lookup_table, layer_idx),
            _elems(output.unsafe_ptr()),
            _elems(q.unsafe_ptr()),
            _u32(input_row_offsets.unsafe_ptr()),
            cache_lengths.dim_size(0),
            q.dim_size(0),
            q.dim_size(1),
            output.dim_size(2),
            scale.unsafe_ptr()[unsafe_offset=0],
            ctx,
        )
