"""MAX's own attention kernel on mokv's caches: the one place mokv calls MAX's kernel
library (its internal Mojo API, MAX 26.7), so that an upgrade of MAX is a port of this
file.

On a GPU, mokv's attention op runs MAX's `generic_flash_attention_kv_cache_ragged` (its
Hopper and MI300 kernels, split keys as MAX decides) on a MAX view of mokv's collection:
mokv's pages and slots are byte-identical to MAX's, so the view is three tensor views
over the same pointers, nothing is copied (but for scaled FP8 pages, which MAX's
kernel cannot read: `paged_scaled_attention_with_max` copies them, dequantized, into a
bfloat16 scratch first). On the CPU mokv's own kernels run (faster
than MAX's there); the define `MOKV_MAX_KERNELS=true` makes the CPU run MAX's kernel
through this same view, which is how the suite checks the view against numpy on a
machine without a GPU.

What MAX's views need beyond mokv's tables, and where it comes from:
  * paged: `max_seq_length` and `max_cache_length`, from `max_lengths` row 0 (mokv's
    collection keeps them; the row is MAX's: most new tokens of a sequence, most cache +
    new tokens). MAX's GPU kernels may read up to 16 lookup-table entries past a row's
    pages: every fetch pads the rows as MAX does (python/mokv/layouts/max_paged.py).
  * continuous: seed 002's inputs carry no max lengths, so the view gets bounds from the
    batch: new tokens of one sequence <= total - batch + 1 (exactly 1 for a decode
    batch, which keeps MAX on its decode kernels), cache + new tokens <= `max_seq_len`
    (the slot's capacity; MAX sizes its key splits from it, never its results).
"""

from std.math import ceildiv
from std.sys.defines import get_defined_bool

from kv_cache.types import (
    ContinuousBatchingKVCacheCollection as MaxContinuousCollection,
    KVCacheStaticParams as MaxKVCacheStaticParams,
    KVCollectionT as MaxKVCollectionT,
    PagedKVCacheCollection as MaxPagedCollection,
)
from layout import Coord, Idx, TileTensor, row_major
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from nn.attention.gpu.mha import MHADecodeDispatchMetadata
from nn.attention.gpu.mha_decode_partition_heuristic import mha_decoding_num_partitions
from nn.kv_cache_ragged import generic_flash_attention_kv_cache_ragged

from ..continuous import ContinuousBatchingKVCacheCollection
from ..paged import PagedKVCacheCollection
from ..types import Ptr, U32Ptr, is_quantized
from .fp8_gpu import dequantize_pages
from .unscaled_fp8 import cast_on_gpu

comptime MAX_KERNELS_ON_CPU = get_defined_bool["MOKV_MAX_KERNELS", False]()
"""Whether the CPU runs MAX's attention too (see the module docstring)."""


@always_inline
def uses_max_attention[target: StaticString]() -> Bool:
    """Whether mokv's attention op runs MAX's kernel for `target`: on every GPU."""
    return not is_cpu[target]() or MAX_KERNELS_ON_CPU


def _max_attention[Coll: MaxKVCollectionT, q_dtype: DType, out_dtype: DType, n_q: Int, window: Int, target: StaticString](
    collection: Coll,
    output: Ptr[out_dtype],  # [total_tokens, n_q, D]
    q: Ptr[q_dtype],  # [total_tokens, n_q, D]
    offsets: U32Ptr,  # [batch_size + 1]
    batch_size: Int,
    total_tokens: Int,
    layer_idx: Int,
    scale: Float32,
    max_new_tokens: Int,
    max_cache_length: Int,  # cache + new tokens, or an upper bound
    ctx: DeviceContext,
) raises:
    """MAX's ragged causal flash attention over a MAX collection, with its
    `sliding_window_causal` mask of `window` keys when `window` > 0. Its query heads
    and the window are parameters: MAX's kernel takes the heads from q's static shape
    and the window as its mask's parameter."""
    comptime D = Coll.kv_params.head_size
    var partitions = 1
    comptime if not is_cpu[target]():
        partitions = mha_decoding_num_partitions(batch_size, max_cache_length, Coll.kv_params.num_heads, ctx)
    var shape = row_major(Coord(total_tokens, Idx[n_q], Idx[D]))
    var q_view = TileTensor(q.unsafe_origin_cast[MutAnyOrigin](), shape)
    var out_view = TileTensor(output.unsafe_origin_cast[MutAnyOrigin](), shape)
    var offsets_view = TileTensor(offsets.unsafe_origin_cast[MutAnyOrigin](), row_major(Coord(batch_size + 1))).as_imm()
    var metadata = MHADecodeDispatchMetadata(batch_size, max_new_tokens, partitions, max_cache_length)
    comptime if window > 0:
        generic_flash_attention_kv_cache_ragged[
            target=target, mask_str="sliding_window_causal", local_window_size=window
        ](q_view, offsets_view, collection, UInt32(layer_idx), scale, out_view, ctx, metadata)
    else:
        generic_flash_attention_kv_cache_ragged[target=target, mask_str="causal"](
            q_view, offsets_view, collection, UInt32(layer_idx), scale, out_view, ctx, metadata
        )


def _attention_over[Coll: MaxKVCollectionT, q_dtype: DType, n_q: Int, window: Int, target: StaticString](
    collection: Coll,
    output: Ptr[q_dtype],  # [total_tokens, n_q, D]
    q: Ptr[q_dtype],  # [total_tokens, n_q, D]
    offsets: U32Ptr,
    batch_size: Int,
    total_tokens: Int,
    layer_idx: Int,
    scale: Float32,
    max_new_tokens: Int,
    max_cache_length: Int,
    ctx: DeviceContext,
) raises:
    """`_max_attention` for the op: as it is, or over (unscaled) FP8 pages through MAX's
    native FP8 path (kernels/unscaled_fp8.mojo): the queries cast to e4m3fn and a
    bfloat16 output, cast to q's dtype unless it is bfloat16. Scratch buffers are
    stream-ordered, kept alive until every kernel that reads them is enqueued."""
    comptime if not is_quantized[Coll.dtype]():
        _max_attention[n_q=n_q, window=window, target=target](
            collection, output, q, offsets, batch_size, total_tokens, layer_idx, scale, max_new_tokens, max_cache_length, ctx
        )
    else:
        comptime assert not is_cpu[target](), "FP8 pages on the CPU: mokv's kernels (docs/quantized.md)"
        comptime FP8 = DType.float8_e4m3fn
        comptime BF16 = DType.bfloat16
        var n = total_tokens * n_q * Coll.kv_params.head_size
        var q8 = ctx.enqueue_create_buffer[FP8](n)
        var q8_ptr = q8.unsafe_ptr().unsafe_mut_cast[True]().unsafe_origin_cast[MutUntrackedOrigin]()
        cast_on_gpu(q8_ptr, q, n, ctx)
        comptime if q_dtype == BF16:
            _max_attention[n_q=n_q, window=window, target=target](
                collection, rebind[Ptr[BF16]](output), q8_ptr, offsets, batch_size, total_tokens, layer_idx, scale,
                max_new_tokens, max_cache_length, ctx,
            )
        else:
            var out16 = ctx.enqueue_create_buffer[BF16](n)
            var out16_ptr = out16.unsafe_ptr().unsafe_mut_cast[True]().unsafe_origin_cast[MutUntrackedOrigin]()
            _max_attention[n_q=n_q, window=window, target=target](
                collection, out16_ptr, q8_ptr, offsets, batch_size, total_tokens, layer_idx, scale,
                max_new_tokens, max_cache_length, ctx,
            )
            cast_on_gpu(output, out16_ptr, n, ctx)
            _ = out16^
        _ = q8^


def paged_attention_with_max[dtype_code: Int, H: Int, D: Int, page_size: Int, q_dtype: DType, n_q: Int, window: Int, target: StaticString](
    coll: PagedKVCacheCollection[dtype_code, H, D, page_size],
    output: Ptr[q_dtype],
    q: Ptr[q_dtype],
    offsets: U32Ptr,
    total_tokens: Int,
    layer_idx: Int,
    scale: Float32,
    ctx: DeviceContext,
) raises:
    """The attention op on a paged cache, through MAX's kernel (see the module)."""
    comptime Coll = PagedKVCacheCollection[dtype_code, H, D, page_size]
    comptime dtype = Coll.dtype
    comptime assert not Coll.scaled, "scaled FP8 pages: mokv's CPU kernels only (docs/quantized.md)"
    var blocks = TileTensor(
        coll.blocks.unsafe_origin_cast[MutAnyOrigin](),
        row_major(Coord(coll.num_pages, Idx[2], coll.num_layers(), Idx[page_size], Idx[H], Idx[D])),
    )
    var lengths = TileTensor(coll.cache_lengths.unsafe_origin_cast[MutAnyOrigin](), row_major(Coord(coll.batch_size()))).as_imm()
    var table = TileTensor(
        coll.lookup_table.unsafe_origin_cast[MutAnyOrigin](), row_major(Coord(coll.batch_size(), coll.max_num_pages))
    ).as_imm()
    var max_cache = coll.max_cache_length
    var view = MaxPagedCollection[
        dtype, MaxKVCacheStaticParams(num_heads=H, head_size=D), page_size, MutAnyOrigin, ImmutAnyOrigin, ImmutAnyOrigin, MutAnyOrigin
    ](blocks, lengths, table, UInt32(coll.max_new_tokens), UInt32(max_cache))
    _attention_over[n_q=n_q, window=window, target=target](
        view, output, q, offsets, coll.batch_size(), total_tokens, layer_idx, scale, coll.max_new_tokens, max_cache, ctx
    )


def continuous_attention_with_max[dtype_code: Int, H: Int, D: Int, q_dtype: DType, n_q: Int, window: Int, target: StaticString](
    coll: ContinuousBatchingKVCacheCollection[dtype_code, H, D],
    output: Ptr[q_dtype],
    q: Ptr[q_dtype],
    offsets: U32Ptr,
    total_tokens: Int,
    layer_idx: Int,
    scale: Float32,
    ctx: DeviceContext,
) raises:
    """The attention op on a continuous cache, through MAX's kernel (see the module)."""
    comptime Coll = ContinuousBatchingKVCacheCollection[dtype_code, H, D]
    comptime dtype = Coll.dtype
    comptime assert not Coll.scaled, "scaled FP8 pages: mokv's CPU kernels only (docs/quantized.md)"
    var batch_size = coll.batch_size()
    var blocks = TileTensor(
        coll.blocks.unsafe_origin_cast[MutAnyOrigin](),
        row_major(Coord(coll.num_slots, Idx[2], coll.num_layers(), coll.max_seq_len, Idx[H], Idx[D])),
    )
    var lengths = TileTensor(coll.cache_lengths.unsafe_origin_cast[MutAnyOrigin](), row_major(Coord(batch_size))).as_imm()
    var slots = TileTensor(coll.lookup_table.unsafe_origin_cast[MutAnyOrigin](), row_major(Coord(batch_size))).as_imm()
    var max_new = total_tokens - batch_size + 1
    var view = MaxContinuousCollection[dtype, MaxKVCacheStaticParams(num_heads=H, head_size=D)](
        blocks, lengths, slots, UInt32(max_new), UInt32(coll.max_seq_len)
    )
    _attention_over[n_q=n_q, window=window, target=target](
        view, output, q, offsets, batch_size, total_tokens, layer_idx, scale, max_new, coll.max_seq_len, ctx
    )


def paged_scaled_attention_with_max[dtype_code: Int, H: Int, D: Int, page_size: Int, q_dtype: DType, n_q: Int, window: Int, target: StaticString](
    coll: PagedKVCacheCollection[dtype_code, H, D, page_size],
    output: Ptr[q_dtype],
    q: Ptr[q_dtype],
    offsets: U32Ptr,
    total_tokens: Int,
    layer_idx: Int,
    scale: Float32,
    ctx: DeviceContext,
) raises:
    """The attention op on scaled FP8 pages: MAX's kernel reads no per-block scales, so
    the pages this batch reads in this layer are first dequantized into a bfloat16
    scratch cache of one layer (kernels/fp8_gpu.mojo), and MAX's kernel runs over it
    as over a bfloat16 cache. The scratch and its table are stream-ordered buffers,
    kept alive until MAX's kernel is enqueued."""
    comptime BF16 = DType.bfloat16
    comptime assert q_dtype == BF16, "attention over scaled FP8 pages takes bfloat16 queries (MAX's kernel over the bfloat16 scratch)"
    var batch_size = coll.batch_size()
    var cols = coll.max_num_pages
    var pages_per_row = max(1, min(cols, ceildiv(coll.max_cache_length, page_size)))
    var num_pages = batch_size * pages_per_row
    var scratch = ctx.enqueue_create_buffer[BF16](max(1, num_pages) * 2 * page_size * H * D)
    var table = ctx.enqueue_create_buffer[DType.uint32](max(1, batch_size * cols))
    var scratch_ptr = scratch.unsafe_ptr().unsafe_mut_cast[True]().unsafe_origin_cast[MutUntrackedOrigin]()
    var table_ptr = table.unsafe_ptr().unsafe_mut_cast[True]().unsafe_origin_cast[MutUntrackedOrigin]()
    dequantize_pages[target=target](coll, layer_idx, offsets, scratch_ptr, table_ptr, pages_per_row, ctx)
    var blocks = TileTensor(
        scratch_ptr.unsafe_origin_cast[MutAnyOrigin](),
        row_major(Coord(max(1, num_pages), Idx[2], Idx[1], Idx[page_size], Idx[H], Idx[D])),
    )
    var lengths = TileTensor(coll.cache_lengths.unsafe_origin_cast[MutAnyOrigin](), row_major(Coord(batch_size))).as_imm()
    var table_view = TileTensor(table_ptr.unsafe_origin_cast[MutAnyOrigin](), row_major(Coord(batch_size, cols))).as_imm()
    var view = MaxPagedCollection[
        BF16, MaxKVCacheStaticParams(num_heads=H, head_size=D), page_size, MutAnyOrigin, ImmutAnyOrigin, ImmutAnyOrigin, MutAnyOrigin
    ](blocks, lengths, table_view, UInt32(coll.max_new_tokens), UInt32(coll.max_cache_length))
    _max_attention[n_q=n_q, window=window, target=target](
        view, output, q, offsets, batch_size, total_tokens, 0, scale, coll.max_new_tokens, coll.max_cache_length, ctx
    )
    _ = scratch^
    _ = table^
