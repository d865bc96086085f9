"""Wrapper of `mokv.store_kv.ragged.<cache>`: write this step's K and V into the cache."""

from __future__ import annotations

from typing import Any

from max.graph import TensorValue, ops

from ..checks import check_device, check_dtype, check_rank, check_same_dim, check_static_dim
from ..layouts import collection_info
from ._checks import (
    check_activation_dtype,
    check_row_offsets,
    emit_table_check,
    layer_index,
    wants_check,
)


def store_kv(
    collection: Any,
    k: TensorValue,
    v: TensorValue,
    input_row_offsets: TensorValue,
    layer_idx: int | TensorValue,
    checked: bool | None = None,
) -> None:
    """Stores new K and V rows of one layer at each sequence's cache position.

    Token `i` of batch entry `b` (flat row `input_row_offsets[b] + i`) is written at
    position `cache_lengths[b] + i`. The op mutates the cache buffer in place; it is
    ordered with the other ops of the device's chain.

    Args:
        collection: a `PagedKVCacheCollection` or `ContinuousBatchingKVCacheCollection`.
        k: [total_tokens, n_kv_heads, head_dim], the cache's dtype (a float8_e4m3fn
            cache: float32, bfloat16 or float16, quantized per 128 lanes as written).
        v: [total_tokens, n_kv_heads, head_dim], k's dtype.
        input_row_offsets: uint32 [batch_size + 1], row offsets of each batch entry.
        layer_idx: layer to write (int, or a uint32 scalar tensor on the host); an int
            must be below the collection's num_layers.
        checked: check the runtime tables first (`mokv.check_tables`); None: the
            collection's `checked` (see `FetchKVCacheCollection`).
    """
    info = collection_info("collection", collection)
    k, v = TensorValue(k), TensorValue(v)
    for name, x in (("k", k), ("v", v)):
        check_activation_dtype(name, x, info.dtype, "store_kv", info.scaled)
        check_rank(name, x, 3)
        check_static_dim(name, x, 1, info.num_heads)
        check_static_dim(name, x, 2, info.head_size)
    check_dtype("v", v, k.dtype)
    check_same_dim("k", k, 0, "v", v, 0)
    check_device("v", v, k.device)
    offsets = check_row_offsets(input_row_offsets, k.device)
    layer = layer_index(layer_idx, info.num_layers)
    if wants_check(info, checked):
        collection = emit_table_check(collection, info, offsets, k, layer)
    ops.inplace_custom(
        info.layout.op_name("store_kv"),
        k.device,
        [collection, k, v, offsets, layer],
    )
