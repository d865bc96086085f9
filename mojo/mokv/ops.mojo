"""Graph-facing ops: only the `@register` structs; the work is in mokv/kernels/.

Names follow `mokv.<op>.<layout>.<cache>`. Each cache kind gets one small struct that
unpacks the graph tensors into raw pointers and calls the one generic implementation.

Conventions shared by every op:
  * tensors are dense row-major (what the graph hands a custom op);
  * `layer_idx` is a uint32 [1] tensor on the host, so one compiled kernel serves
    every layer (a kernel parameter would compile one instance per layer);
  * consumers take the opaque collection BY VALUE (26.7 rejects `mut` opaque args) and
    write through its pointers.
"""

from extensibility import register, InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext

from .continuous import ContinuousBatchingKVCacheCollection
from .paged import PagedKVCacheCollection
from .types import Ptr, U32Ptr, is_quantized
from .kernels.attention import flash_attention
from .kernels.fused_qkv import fused_qkv_matmul, qkv_epilogue
from .kernels.max_kernels import (
    continuous_attention_with_max,
    paged_attention_with_max,
    paged_scaled_attention_with_max,
    uses_max_attention,
)
from .kernels.store_kv import store_kv
from .types import KVCollectionT


@always_inline
def _u32[origin: Origin, //](p: Pointer[UInt32, origin]) -> U32Ptr:
    return p.unsafe_mut_cast[True]().unsafe_origin_cast[MutUntrackedOrigin]()


@always_inline
def _f32[origin: Origin, //](p: Pointer[Float32, origin]) -> Pointer[Float32, MutUntrackedOrigin]:
    return p.unsafe_mut_cast[True]().unsafe_origin_cast[MutUntrackedOrigin]()


@always_inline
def _elems[dt: DType, origin: Origin, //](p: Pointer[Scalar[dt], origin]) -> Ptr[dt]:
    return p.unsafe_mut_cast[True]().unsafe_origin_cast[MutUntrackedOrigin]()


# ===----------------------------------------------------------------------=== #
# Collection constructors: flat graph inputs (python/mokv/layouts/) -> opaque view
# ===----------------------------------------------------------------------=== #


@register("mokv.kv_collection_ctor.continuous")
struct ContinuousKVCollectionCtor:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, target: StaticString](
        blocks: MutableInputTensor[rank=6, ...],  # [max_batch_size, 2, num_layers, max_seq_len, H, D]
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size]
        lookup_table: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size]
        is_cache_empty: InputTensor[dtype=DType.bool, rank=1, ...],  # [1], host
        ctx: DeviceContext,
    ) raises -> ContinuousBatchingKVCacheCollection[dtype_code, num_heads, head_size]:
        comptime Coll = ContinuousBatchingKVCacheCollection[dtype_code, num_heads, head_size]
        comptime assert not Coll.scaled, "an FP8 cache's collection takes its scales: mokv.kv_collection_ctor.continuous.scaled"
        # MAX's unscaled FP8 pages (dtype code 4): on a GPU only (kernels/unscaled_fp8.mojo).
        comptime assert not is_quantized[Coll.dtype]() or not is_cpu[target](), "unscaled FP8 pages: on a GPU only (docs/quantized.md)"
        return Coll(
            _elems(blocks.unsafe_ptr()),
            # No scales: any valid address (Mojo's pointers are non-null), never read.
            _u32(cache_lengths.unsafe_ptr()).unsafe_bitcast[Float32](),
            _u32(cache_lengths.unsafe_ptr()),
            _u32(lookup_table.unsafe_ptr()),
            cache_lengths.dim_size(0),
            blocks.dim_size(0),
            blocks.dim_size(2),
            blocks.dim_size(3),
            Bool(is_cache_empty.unsafe_ptr()[unsafe_offset=0]),
        )


@register("mokv.kv_collection_ctor.continuous.scaled")
struct ContinuousScaledKVCollectionCtor:
    """A float8_e4m3fn continuous cache with MAX 26.7's per-block scales: the values
    and, beside them, one float32 scale per (slot, k|v, layer, token, head, 128 lanes)."""

    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, target: StaticString](
        blocks: MutableInputTensor[rank=6, ...],  # [max_batch_size, 2, num_layers, max_seq_len, H, D]
        scales: MutableInputTensor[dtype=DType.float32, rank=6, ...],  # [max_batch_size, 2, num_layers, max_seq_len, H, D // 128]
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size]
        lookup_table: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size]
        is_cache_empty: InputTensor[dtype=DType.bool, rank=1, ...],  # [1], host
        ctx: DeviceContext,
    ) raises -> ContinuousBatchingKVCacheCollection[dtype_code, num_heads, head_size]:
        comptime Coll = ContinuousBatchingKVCacheCollection[dtype_code, num_heads, head_size]
        comptime assert Coll.scaled, "only scaled FP8 pages (dtype code 3) have scales"
        comptime assert is_cpu[target](), "scaled FP8 pages: mokv's CPU kernels only (MAX 26.7's GPU MHA kernels read no scales)"
        return Coll(
            _elems(blocks.unsafe_ptr()),
            _f32(scales.unsafe_ptr()),
            _u32(cache_lengths.unsafe_ptr()),
            _u32(lookup_table.unsafe_ptr()),
            cache_lengths.dim_size(0),
            blocks.dim_size(0),
            blocks.dim_size(2),
            blocks.dim_size(3),
            Bool(is_cache_empty.unsafe_ptr()[unsafe_offset=0]),
        )


@register("mokv.kv_collection_ctor.paged")
struct PagedKVCollectionCtor:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, page_size: Int, target: StaticString](
        blocks: MutableInputTensor[rank=6, ...],  # [total_num_pages, 2, num_layers, page_size, H, D]
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size]
        lookup_table: InputTensor[dtype=DType.uint32, rank=2, ...],  # [batch_size, max_num_pages]
        max_lengths: InputTensor[dtype=DType.uint32, rank=2, ...],  # [num_steps, 2], host
        ctx: DeviceContext,
    ) raises -> PagedKVCacheCollection[dtype_code, num_heads, head_size, page_size]:
        comptime Coll = PagedKVCacheCollection[dtype_code, num_heads, head_size, page_size]
        comptime assert not Coll.scaled, "an FP8 cache's collection takes its scales: mokv.kv_collection_ctor.paged.scaled"
        # MAX's unscaled FP8 pages (dtype code 4): on a GPU only (kernels/unscaled_fp8.mojo).
        comptime assert not is_quantized[Coll.dtype]() or not is_cpu[target](), "unscaled FP8 pages: on a GPU only (docs/quantized.md)"
        var ml = max_lengths.unsafe_ptr()
        return Coll(
            _elems(blocks.unsafe_ptr()),
            # No scales: any valid address (Mojo's pointers are non-null), never read.
            _u32(cache_lengths.unsafe_ptr()).unsafe_bitcast[Float32](),
            _u32(cache_lengths.unsafe_ptr()),
            _u32(lookup_table.unsafe_ptr()),
            cache_lengths.dim_size(0),
            lookup_table.dim_size(1),
            blocks.dim_size(0),
            blocks.dim_size(2),
            Int(ml[unsafe_offset=0]),
            Int(ml[unsafe_offset=1]),
        )


@register("mokv.kv_collection_ctor.paged.scaled")
struct PagedScaledKVCollectionCtor:
    """A float8_e4m3fn paged cache (MAX 26.7's scaled FP8 layout): the values and,
    beside them, one float32 scale per (page, k|v, layer, token, head, 128 lanes)."""

    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, page_size: Int, target: StaticString](
        blocks: MutableInputTensor[rank=6, ...],  # [total_num_pages, 2, num_layers, page_size, H, D]
        scales: MutableInputTensor[dtype=DType.float32, rank=6, ...],  # [total_num_pages, 2, num_layers, page_size, H, D // 128]
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size]
        lookup_table: InputTensor[dtype=DType.uint32, rank=2, ...],  # [batch_size, max_num_pages]
        max_lengths: InputTensor[dtype=DType.uint32, rank=2, ...],  # [num_steps, 2], host
        ctx: DeviceContext,
    ) raises -> PagedKVCacheCollection[dtype_code, num_heads, head_size, page_size]:
        comptime Coll = PagedKVCacheCollection[dtype_code, num_heads, head_size, page_size]
        comptime assert Coll.scaled, "only scaled FP8 pages (dtype code 3) have scales"
        var ml = max_lengths.unsafe_ptr()
        return Coll(
            _elems(blocks.unsafe_ptr()),
            _f32(scales.unsafe_ptr()),
            _u32(cache_lengths.unsafe_ptr()),
            _u32(lookup_table.unsafe_ptr()),
            cache_lengths.dim_size(0),
            lookup_table.dim_size(1),
            blocks.dim_size(0),
            blocks.dim_size(2),
            Int(ml[unsafe_offset=0]),
            Int(ml[unsafe_offset=1]),
        )


# ===----------------------------------------------------------------------=== #
# store_kv
# ===----------------------------------------------------------------------=== #


@register("mokv.store_kv.ragged.continuous")
struct StoreKVContinuous:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, //, target: StaticString](
        collection: ContinuousBatchingKVCacheCollection[dtype_code, num_heads, head_size],
        k: InputTensor[rank=3, ...],  # [total_tokens, H, D]
        v: InputTensor[dtype=k.dtype, rank=3, ...],  # [total_tokens, H, D]
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size + 1]
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],  # [1], host
        ctx: DeviceContext,
    ) raises:
        store_kv[target=target](
            collection,
            _elems(k.unsafe_ptr()),
            _elems(v.unsafe_ptr()),
            _u32(input_row_offsets.unsafe_ptr()),
            k.dim_size(0),
            Int(layer_idx.unsafe_ptr()[unsafe_offset=0]),
            ctx,
        )


@register("mokv.store_kv.ragged.paged")
struct StoreKVPaged:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, page_size: Int, //, target: StaticString](
        collection: PagedKVCacheCollection[dtype_code, num_heads, head_size, page_size],
        k: InputTensor[rank=3, ...],  # [total_tokens, H, D]
        v: InputTensor[dtype=k.dtype, rank=3, ...],  # [total_tokens, H, D]
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size + 1]
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],  # [1], host
        ctx: DeviceContext,
    ) raises:
        store_kv[target=target](
            collection,
            _elems(k.unsafe_ptr()),
            _elems(v.unsafe_ptr()),
            _u32(input_row_offsets.unsafe_ptr()),
            k.dim_size(0),
            Int(layer_idx.unsafe_ptr()[unsafe_offset=0]),
            ctx,
        )


# ===----------------------------------------------------------------------=== #
# fused_qkv_matmul (+ .rope)
# ===----------------------------------------------------------------------=== #


def _fused_qkv[Coll: KVCollectionT, rope: Bool, target: StaticString](
    collection: Coll,
    output: OutputTensor[rank=2, ...],  # [total_tokens, n_q * D]
    hidden: InputTensor[dtype=output.dtype, rank=2, ...],  # [total_tokens, hidden_size]
    wqkv: InputTensor[dtype=output.dtype, rank=2, ...],  # [(n_q + 2 * n_kv) * D, hidden_size]
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size + 1]
    layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],  # [1], host
    freqs: Pointer[Float32, MutUntrackedOrigin],  # [max_seq_len, D] or null
    ctx: DeviceContext,
) raises:
    comptime D = Coll.CacheType.kv_params.head_size
    fused_qkv_matmul[Coll, output.dtype, rope, target](
        collection,
        _elems(output.unsafe_ptr()),
        _elems(hidden.unsafe_ptr()),
        _elems(wqkv.unsafe_ptr()),
        _u32(input_row_offsets.unsafe_ptr()),
        freqs,
        hidden.dim_size(0),
        hidden.dim_size(1),
        output.dim_size(1) // D,
        Int(layer_idx.unsafe_ptr()[unsafe_offset=0]),
        ctx,
    )


@always_inline
def _no_freqs[origin: Origin, //](p: Pointer[UInt32, origin]) -> Pointer[Float32, MutUntrackedOrigin]:
    """A placeholder for the unused `freqs` of the no-RoPE variant (never dereferenced).

    Pointer is non-nullable in Mojo 1.2, so any valid address stands in for "none".
    """
    return _u32(p).unsafe_bitcast[Float32]()


@register("mokv.fused_qkv_matmul.ragged.continuous")
struct FusedQKVMatmulContinuous:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, //, target: StaticString](
        output: OutputTensor[rank=2, ...],
        hidden: InputTensor[dtype=output.dtype, rank=2, ...],
        wqkv: InputTensor[dtype=output.dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        collection: ContinuousBatchingKVCacheCollection[dtype_code, num_heads, head_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        _fused_qkv[rope=False, target=target](collection, output, hidden, wqkv, input_row_offsets, layer_idx, _no_freqs(layer_idx.unsafe_ptr()), ctx)


@register("mokv.fused_qkv_matmul.ragged.paged")
struct FusedQKVMatmulPaged:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, page_size: Int, //, target: StaticString](
        output: OutputTensor[rank=2, ...],
        hidden: InputTensor[dtype=output.dtype, rank=2, ...],
        wqkv: InputTensor[dtype=output.dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        collection: PagedKVCacheCollection[dtype_code, num_heads, head_size, page_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        _fused_qkv[rope=False, target=target](collection, output, hidden, wqkv, input_row_offsets, layer_idx, _no_freqs(layer_idx.unsafe_ptr()), ctx)


@register("mokv.fused_qkv_matmul.ragged.continuous.rope")
struct FusedQKVMatmulRopeContinuous:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, //, target: StaticString](
        output: OutputTensor[rank=2, ...],
        hidden: InputTensor[dtype=output.dtype, rank=2, ...],
        wqkv: InputTensor[dtype=output.dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        collection: ContinuousBatchingKVCacheCollection[dtype_code, num_heads, head_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        freqs_cis: InputTensor[dtype=DType.float32, rank=2, ...],  # [max_seq_len, D]
        ctx: DeviceContext,
    ) raises:
        _fused_qkv[rope=True, target=target](
            collection, output, hidden, wqkv, input_row_offsets, layer_idx, _f32(freqs_cis.unsafe_ptr()), ctx
        )


@register("mokv.fused_qkv_matmul.ragged.paged.rope")
struct FusedQKVMatmulRopePaged:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, page_size: Int, //, target: StaticString](
        output: OutputTensor[rank=2, ...],
        hidden: InputTensor[dtype=output.dtype, rank=2, ...],
        wqkv: InputTensor[dtype=output.dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        collection: PagedKVCacheCollection[dtype_code, num_heads, head_size, page_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        freqs_cis: InputTensor[dtype=DType.float32, rank=2, ...],  # [max_seq_len, D]
        ctx: DeviceContext,
    ) raises:
        _fused_qkv[rope=True, target=target](
            collection, output, hidden, wqkv, input_row_offsets, layer_idx, _f32(freqs_cis.unsafe_ptr()), ctx
        )


# ===----------------------------------------------------------------------=== #
# qkv_epilogue (+ .rope): the GPU half of fused_qkv_matmul, after MAX's matmul
# ===----------------------------------------------------------------------=== #


def _qkv_epilogue[Coll: KVCollectionT, rope: Bool, target: StaticString](
    collection: Coll,
    output: OutputTensor[rank=2, ...],  # [total_tokens, n_q * D]
    qkv: InputTensor[dtype=output.dtype, rank=2, ...],  # [total_tokens, (n_q + 2 * n_kv) * D]
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size + 1]
    layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],  # [1], host
    freqs: Pointer[Float32, MutUntrackedOrigin],  # [max_seq_len, D] or unused
    ctx: DeviceContext,
) raises:
    comptime D = Coll.CacheType.kv_params.head_size
    qkv_epilogue[Coll, output.dtype, rope, target](
        collection,
        _elems(output.unsafe_ptr()),
        _elems(qkv.unsafe_ptr()),
        _u32(input_row_offsets.unsafe_ptr()),
        freqs,
        qkv.dim_size(0),
        output.dim_size(1) // D,
        Int(layer_idx.unsafe_ptr()[unsafe_offset=0]),
        ctx,
    )


@register("mokv.qkv_epilogue.ragged.continuous")
struct QKVEpilogueContinuous:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, //, target: StaticString](
        output: OutputTensor[rank=2, ...],
        qkv: InputTensor[dtype=output.dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        collection: ContinuousBatchingKVCacheCollection[dtype_code, num_heads, head_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        _qkv_epilogue[rope=False, target=target](collection, output, qkv, input_row_offsets, layer_idx, _no_freqs(layer_idx.unsafe_ptr()), ctx)


@register("mokv.qkv_epilogue.ragged.paged")
struct QKVEpiloguePaged:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, page_size: Int, //, target: StaticString](
        output: OutputTensor[rank=2, ...],
        qkv: InputTensor[dtype=output.dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        collection: PagedKVCacheCollection[dtype_code, num_heads, head_size, page_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        _qkv_epilogue[rope=False, target=target](collection, output, qkv, input_row_offsets, layer_idx, _no_freqs(layer_idx.unsafe_ptr()), ctx)


@register("mokv.qkv_epilogue.ragged.continuous.rope")
struct QKVEpilogueRopeContinuous:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, //, target: StaticString](
        output: OutputTensor[rank=2, ...],
        qkv: InputTensor[dtype=output.dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        collection: ContinuousBatchingKVCacheCollection[dtype_code, num_heads, head_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        freqs_cis: InputTensor[dtype=DType.float32, rank=2, ...],  # [max_seq_len, D]
        ctx: DeviceContext,
    ) raises:
        _qkv_epilogue[rope=True, target=target](collection, output, qkv, input_row_offsets, layer_idx, _f32(freqs_cis.unsafe_ptr()), ctx)


@register("mokv.qkv_epilogue.ragged.paged.rope")
struct QKVEpilogueRopePaged:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, page_size: Int, //, target: StaticString](
        output: OutputTensor[rank=2, ...],
        qkv: InputTensor[dtype=output.dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        collection: PagedKVCacheCollection[dtype_code, num_heads, head_size, page_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        freqs_cis: InputTensor[dtype=DType.float32, rank=2, ...],  # [max_seq_len, D]
        ctx: DeviceContext,
    ) raises:
        _qkv_epilogue[rope=True, target=target](collection, output, qkv, input_row_offsets, layer_idx, _f32(freqs_cis.unsafe_ptr()), ctx)


# ===----------------------------------------------------------------------=== #
# flash_attention
# ===----------------------------------------------------------------------=== #


def _attention[Coll: KVCollectionT, target: StaticString](
    output: OutputTensor[rank=3, ...],  # [total_tokens, n_q, D]
    q: InputTensor[dtype=output.dtype, rank=3, ...],  # [total_tokens, n_q, D]
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size + 1]
    collection: Coll,
    layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],  # [1], host
    scale: InputTensor[dtype=DType.float32, rank=1, ...],  # [1], host
    sinks: InputTensor[dtype=DType.float32, rank=1, ...],  # [0] or [n_q]: attention sinks
    window_size: Int,  # 0: causal; else a sliding window of that many keys
    ctx: DeviceContext,
) raises:
    """mokv's own attention (the CPU's)."""
    flash_attention[Coll, output.dtype, target](
        collection,
        _elems(output.unsafe_ptr()),
        _elems(q.unsafe_ptr()),
        _u32(input_row_offsets.unsafe_ptr()),
        q.dim_size(0),
        q.dim_size(1),
        Int(layer_idx.unsafe_ptr()[unsafe_offset=0]),
        scale.unsafe_ptr()[unsafe_offset=0],
        window_size,
        _f32(sinks.unsafe_ptr()),
        sinks.dim_size(0),
        ctx,
    )


# On a GPU both ops run MAX's attention kernel on a MAX view of the collection
# (kernels/max_kernels.mojo); on the CPU, mokv's. `window_size` (a parameter: MAX's
# kernel takes its mask as one) is 0 for causal attention, else the keys a query reads
# of a sliding window, its own included (MAX's `sliding_window_causal` mask). `sinks`
# is float32 [n_q], each query head's attention-sink logit (GPT-OSS's), or [0] for none.


@register("mokv.flash_attention.ragged.continuous")
struct FlashAttentionContinuous:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, //, target: StaticString, num_q_heads: Int, window_size: Int](
        output: OutputTensor[rank=3, ...],
        q: InputTensor[dtype=output.dtype, rank=3, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        collection: ContinuousBatchingKVCacheCollection[dtype_code, num_heads, head_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        scale: InputTensor[dtype=DType.float32, rank=1, ...],
        sinks: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if uses_max_attention[target]():
            if sinks.dim_size(0):
                raise Error("flash_attention: attention sinks run on mokv's CPU kernel only")
            continuous_attention_with_max[n_q=num_q_heads, window=window_size, target=target](
                collection,
                _elems(output.unsafe_ptr()),
                _elems(q.unsafe_ptr()),
                _u32(input_row_offsets.unsafe_ptr()),
                q.dim_size(0),
                Int(layer_idx.unsafe_ptr()[unsafe_offset=0]),
                scale.unsafe_ptr()[unsafe_offset=0],
                ctx,
            )
        else:
            _attention[target=target](output, q, input_row_offsets, collection, layer_idx, scale, sinks, window_size, ctx)


@register("mokv.flash_attention.ragged.paged")
struct FlashAttentionPaged:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, page_size: Int, //, target: StaticString, num_q_heads: Int, window_size: Int](
        output: OutputTensor[rank=3, ...],
        q: InputTensor[dtype=output.dtype, rank=3, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        collection: PagedKVCacheCollection[dtype_code, num_heads, head_size, page_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        scale: InputTensor[dtype=DType.float32, rank=1, ...],
        sinks: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if uses_max_attention[target]():
            if sinks.dim_size(0):
                raise Error("flash_attention: attention sinks run on mokv's CPU kernel only")
            var out_ptr = _elems(output.unsafe_ptr())
            var q_ptr = _elems(q.unsafe_ptr())
            var offsets = _u32(input_row_offsets.unsafe_ptr())
            var layer = Int(layer_idx.unsafe_ptr()[unsafe_offset=0])
            var softmax_scale = scale.unsafe_ptr()[unsafe_offset=0]
            comptime if PagedKVCacheCollection[dtype_code, num_heads, head_size, page_size].scaled:
                # Scaled FP8 pages: through a bfloat16 scratch (kernels/fp8_gpu.mojo).
                paged_scaled_attention_with_max[n_q=num_q_heads, window=window_size, target=target](
                    collection, out_ptr, q_ptr, offsets, q.dim_size(0), layer, softmax_scale, ctx
                )
            else:
                paged_attention_with_max[n_q=num_q_heads, window=window_size, target=target](
                    collection, out_ptr, q_ptr, offsets, q.dim_size(0), layer, softmax_scale, ctx
                )
        else:
            _attention[target=target](output, q, input_row_offsets, collection, layer_idx, scale, sinks, window_size, ctx)


# ===----------------------------------------------------------------------=== #
# check_tables: checked mode (kernels/checks.mojo); the op wrappers emit it before a
# kernel when checking is on (python/mokv/ops/_checks.py, `emit_table_check`)
# ===----------------------------------------------------------------------=== #
#
# The op returns its collection unchanged and the guarded kernel takes THAT value: a
# data dependency, so the kernel runs only after the check succeeded (when the check
# raises, its output is an error value and the kernel is skipped). MAX 26.7 does not
# keep the device chain's program order between an op that takes the blocks buffer
# and ops that take only the collection, so the chain alone would not order them.

from max.gpu.host.info import is_cpu

from .kernels.checks import check_continuous_tables, check_paged_tables


@register("mokv.check_tables.ragged.paged")
struct CheckTablesPaged:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, page_size: Int, target: StaticString](
        collection: PagedKVCacheCollection[dtype_code, num_heads, head_size, page_size],
        blocks: MutableInputTensor[rank=6, ...],  # [total_num_pages, 2, num_layers, page_size, H, D]; not written
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size]
        lookup_table: InputTensor[dtype=DType.uint32, rank=2, ...],  # [batch_size, max_num_pages]
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size + 1]
        rows: InputTensor[rank=2, ...],  # [total_tokens, *]: the guarded op's token rows
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],  # [1], host
        max_positions: InputTensor[dtype=DType.uint32, rank=1, ...],  # [1], host; 0 = no limit
        ctx: DeviceContext,
    ) raises -> PagedKVCacheCollection[dtype_code, num_heads, head_size, page_size]:
        comptime if not is_cpu[target]():
            raise Error("mokv.check_tables runs on the CPU only (it reads the tables on the host)")
        else:
            check_paged_tables(
                _u32(cache_lengths.unsafe_ptr()),
                cache_lengths.dim_size(0),
                _u32(lookup_table.unsafe_ptr()),
                lookup_table.dim_size(0),
                lookup_table.dim_size(1),
                blocks.dim_size(0),
                blocks.dim_size(2),
                blocks.dim_size(3),
                _u32(input_row_offsets.unsafe_ptr()),
                input_row_offsets.dim_size(0),
                rows.dim_size(0),
                Int(layer_idx.unsafe_ptr()[unsafe_offset=0]),
                Int(max_positions.unsafe_ptr()[unsafe_offset=0]),
            )
            return collection


@register("mokv.check_tables.ragged.continuous")
struct CheckTablesContinuous:
    @staticmethod
    def execute[dtype_code: Int, num_heads: Int, head_size: Int, target: StaticString](
        collection: ContinuousBatchingKVCacheCollection[dtype_code, num_heads, head_size],
        blocks: MutableInputTensor[rank=6, ...],  # [max_batch_size, 2, num_layers, max_seq_len, H, D]; not written
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size]
        lookup_table: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size]
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],  # [batch_size + 1]
        rows: InputTensor[rank=2, ...],  # [total_tokens, *]: the guarded op's token rows
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],  # [1], host
        max_positions: InputTensor[dtype=DType.uint32, rank=1, ...],  # [1], host; 0 = no limit
        ctx: DeviceContext,
    ) raises -> ContinuousBatchingKVCacheCollection[dtype_code, num_heads, head_size]:
        comptime if not is_cpu[target]():
            raise Error("mokv.check_tables runs on the CPU only (it reads the tables on the host)")
        else:
            check_continuous_tables(
                _u32(cache_lengths.unsafe_ptr()),
                cache_lengths.dim_size(0),
                _u32(lookup_table.unsafe_ptr()),
                lookup_table.dim_size(0),
                blocks.dim_size(0),
                blocks.dim_size(2),
                blocks.dim_size(3),
                _u32(input_row_offsets.unsafe_ptr()),
                input_row_offsets.dim_size(0),
                rows.dim_size(0),
                Int(layer_idx.unsafe_ptr()[unsafe_offset=0]),
                Int(max_positions.unsafe_ptr()[unsafe_offset=0]),
            )
            return collection
