"""Wrapper of `mokv.flash_attention.ragged.<cache>`."""

from __future__ import annotations

from typing import Any

import numpy as np
from max.dtype import DType
from max.graph import TensorType, TensorValue, ops

from ..checks import check_device, check_dtype, check_rank, check_static_dim
from ..layouts import collection_info
from ._checks import (
    QUANTIZED_CACHE_DTYPES,
    check_activation_dtype,
    check_gpu_page_size,
    check_group,
    check_head_dim,
    check_native_fp8_attention,
    check_row_offsets,
    emit_table_check,
    host_scalar,
    layer_index,
    wants_check,
)


def flash_attention(
    collection: Any,
    q: TensorValue,
    input_row_offsets: TensorValue,
    layer_idx: int | TensorValue,
    scale: float | TensorValue,
    checked: bool | None = None,
    window_size: int | None = None,
    sinks: TensorValue | None = None,
) -> TensorValue:
    """Causal grouped-query attention of this step's queries over the cached K and V.

    New token `i` of batch entry `b` attends to cache positions [0, cache_lengths[b] + i],
    so its own K/V (and those of earlier new tokens) must already be in the cache
    (`store_kv` or `fused_qkv_matmul` first). A batch may mix prefill and decode rows.
    Query head `qh` reads KV head `qh // (n_heads // n_kv_heads)`.

    With `window_size` W (a sliding-window layer: Gemma 3's local layers, a
    sliding-window cache group's), the token at position p reads only [p - W + 1, p]
    (MAX's `sliding_window_causal` mask: W counts the query's own key), and the kernel
    reads no key before the batch's windows: a sliding-window group has released the
    pages there (`mokv.CacheGroupConfig`), so its layers must pass their window.

    With `sinks` (GPT-OSS's attention sinks), query head h's softmax denominator gets
    e^sinks[h] added: a logit that takes a share of the attention and contributes no
    value (MAX's `flash_attention_ragged(sink_weights=...)`).

    Args:
        collection: a `PagedKVCacheCollection` or `ContinuousBatchingKVCacheCollection`.
        q: [total_tokens, n_heads, head_dim], the cache's dtype (a float8_e4m3fn
            cache: float32, bfloat16 or float16; K and V are dequantized as read).
        input_row_offsets: uint32 [batch_size + 1].
        layer_idx: layer to read (int, or uint32 scalar tensor on the host); an int
            must be below the collection's num_layers.
        scale: softmax scale, usually 1 / sqrt(head_dim) (float, or float32 host scalar).
        checked: check the runtime tables first (`mokv.check_tables`); None: the
            collection's `checked` (see `FetchKVCacheCollection`).
        window_size: keys a query reads, its own included (an int >= 1); None: every
            key before it.
        sinks: [n_heads] float32 or q's dtype on q's device, each query head's sink
            logit (in the units of the scaled scores); None: no sinks. The CPU kernel
            only: refused on a GPU.

    On the CPU this is mokv's kernel; on a GPU, MAX's own attention kernel on a MAX
    view of the same cache (`kernels/max_kernels.mojo`). The CPU kernel needs head_dim
    to be a multiple of 16 and at most 64 query heads per KV head; MAX's GPU kernel, a
    paged cache's pages of a multiple of 128 tokens (as MAX's own cache has). Other
    values are refused here.

    Returns:
        [total_tokens, n_heads, head_dim] in q's dtype.
    """
    info = collection_info("collection", collection)
    q = TensorValue(q)
    check_activation_dtype("q", q, info.dtype, "flash_attention", info.scaled)
    if info.dtype in QUANTIZED_CACHE_DTYPES and not info.scaled:
        check_native_fp8_attention("flash_attention", q.device)
    check_rank("q", q, 3)
    check_static_dim("q", q, 2, info.head_size)
    n_heads = q.shape[1]
    if not hasattr(n_heads, "dim") or int(n_heads) % info.num_heads:
        raise ValueError(
            f"q dim 1 (query heads, {n_heads}) must be a static multiple of the cache's "
            f"{info.num_heads} KV heads"
        )
    if window_size is not None and (window_size.__class__ is not int or window_size < 1):
        raise ValueError(f"window_size must be an int >= 1 or None, got {window_size!r}")
    if sinks is not None:
        _check_sinks(sinks, int(n_heads), q)
    check_head_dim("flash_attention", info.head_size, q.device)
    check_group("flash_attention", int(n_heads), info.num_heads, q.device)
    check_gpu_page_size("flash_attention", info, q.device)
    offsets = check_row_offsets(input_row_offsets, q.device)
    layer = layer_index(layer_idx, info.num_layers)
    if wants_check(info, checked):
        collection = emit_table_check(collection, info, offsets, q, layer)
    out_type = TensorType(q.dtype, q.shape, device=q.device)
    # No sinks: a [0] tensor (the kernel adds none).
    sink_logits = (
        ops.constant(np.zeros(0, np.float32), DType.float32, q.device)
        if sinks is None
        else ops.cast(TensorValue(sinks), DType.float32)
    )
    return ops.inplace_custom(
        info.layout.op_name("flash_attention"),
        q.device,
        [q, offsets, collection, layer, host_scalar("scale", scale, DType.float32), sink_logits],
        out_types=[out_type],
        # MAX's GPU kernel takes the query heads from q's static shape, and its mask's
        # window: parameters (0: the causal mask).
        parameters={"num_q_heads": int(n_heads), "window_size": window_size or 0},
    )[0].tensor


def _check_sinks(sinks: Any, n_heads: int, q: TensorValue) -> None:
    """`sinks` must be [n_heads] float32 or q's dtype on q's device, on the CPU."""
    check_dtype("sinks", sinks, DType.float32, q.dtype)
    check_rank("sinks", sinks, 1)
    check_static_dim("sinks", sinks, 0, n_heads)
    check_device("sinks", sinks, q.device)
    if not q.device.is_cpu():
        raise ValueError(
            f"sinks: attention sinks run on mokv's CPU kernel only, got q on {q.device} "
            "(MAX's sink kernel on a GPU: not wired yet, issue 52)"
        )
