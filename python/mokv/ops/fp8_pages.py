"""The graph value of an FP8 paged cache: values and per-block scales, for the kernels.

MAX 26.7's scaled FP8 cache (`KVCacheQuantizationConfig`, docs/quantized.md) keeps its
scales in a second buffer beside the values; `mokv.kv_collection_ctor.paged.scaled`
builds mokv's collection over both (mojo/mokv/ops.mojo), and `store_kv`,
`fused_qkv_matmul` and `flash_attention` take it as they take any collection: they
quantize as they write and dequantize as they read, on the CPU.
"""

from __future__ import annotations

from typing import Any

from max.dtype import DType
from max.graph import BufferValue, DeviceRef, Graph, TensorValue, ops

from ..checks import check_dtype, check_rank, check_static_dim
from ..config.params import KVCacheParams
from ..layouts.base import _use_mokv_kernels
from ..layouts.paged import PAGED


def fp8_paged_collection(
    kv_params: KVCacheParams,
    blocks: BufferValue,
    scales: BufferValue,
    cache_lengths: TensorValue,
    lookup_table: TensorValue,
    max_lengths: TensorValue,
) -> Any:
    """The `PagedKVCacheCollection` value of a float8_e4m3fn paged cache.

    Args:
        kv_params: a float8_e4m3fn `KVCacheParams` with its `quantization`.
        blocks: float8_e4m3fn [pages, 2, layers, page_size, n_kv_heads, head_dim].
        scales: float32 [pages, 2, layers, page_size, n_kv_heads, head_dim // 128].
        cache_lengths, lookup_table, max_lengths: as a paged cache's
            (`mokv.RaggedKVCacheInputs`).
    """
    if not isinstance(kv_params, KVCacheParams) or kv_params.quantization is None:
        raise ValueError(
            f"fp8_paged_collection needs float8_e4m3fn KVCacheParams with a quantization, "
            f"got {kv_params!r}"
        )
    for name, buf in (("blocks", blocks), ("scales", scales)):
        if not isinstance(buf, BufferValue):
            raise TypeError(f"{name} must be a BufferValue, got {type(buf).__name__}")
        check_rank(name, buf, 6)
        check_static_dim(name, buf, 1, 2)
        check_static_dim(name, buf, 3, kv_params.page_size)
        check_static_dim(name, buf, 4, kv_params.n_kv_heads_per_device)
    check_dtype("blocks", blocks, DType.float8_e4m3fn)
    check_static_dim("blocks", blocks, 5, kv_params.head_dim)
    check_dtype("scales", scales, DType.float32)
    check_static_dim("scales", scales, 5, kv_params.scales_per_head)
    if blocks.device != DeviceRef.CPU():
        raise ValueError(
            f"blocks: an FP8 cache runs on mokv's CPU kernels only, got {blocks.device} "
            "(docs/quantized.md)"
        )
    _use_mokv_kernels(Graph.current)
    out_type = PAGED.CollectionType(kv_params)
    tensors = [TensorValue(t) for t in (cache_lengths, lookup_table, max_lengths)]
    value = ops.inplace_custom(
        "mokv.kv_collection_ctor.paged.scaled",
        blocks.device,
        [blocks, scales, *tensors],
        out_types=[out_type],
        parameters=dict(out_type.parameters),
    )[0]
    collection = PAGED.Collection(value)
    collection.num_layers = int(blocks.shape[2])
    collection.inputs = (blocks, *tensors)
    return collection
