"""Callables that turn a manager's flat cache inputs into the opaque collection value.

    fetch = FetchPagedKVCacheCollection(kv_params, num_layers=2)
    with Graph("g", input_types=[*paged_input_symbols(kv_params, 2, dev), ...]) as g:
        kv = fetch(*g.inputs[:4])           # or fetch(RaggedKVCacheInputs(...))

The argument order is the field order of `mokv.inputs` (= the constructor op's order),
so `fetch(*inputs)` with the NamedTuple of symbols just works.
"""

from __future__ import annotations

from typing import Any

from max.dtype import DType
from max.graph import BufferValue, TensorValue, ops

from ..inputs import ContinuousBatchingKVCacheInputs, RaggedKVCacheInputs
from ..ops._checks import check_dtype, check_rank, check_static_dim
from ..params import KVCacheParams
from .types import (
    ContinuousBatchingKVCacheCollection,
    ContinuousBatchingKVCacheCollectionType,
    PagedKVCacheCollection,
    PagedKVCacheCollectionType,
    dtype_code,
)


def _unpack(inputs: tuple[Any, ...], kind: str) -> tuple[Any, ...]:
    if len(inputs) == 1 and isinstance(inputs[0], tuple):
        inputs = tuple(inputs[0])
    if len(inputs) != 4:
        raise TypeError(f"{kind} expects the 4 cache inputs (or their NamedTuple), got {len(inputs)}")
    return inputs


def _check_blocks(blocks: Any, kv_params: KVCacheParams, num_layers: int | None) -> BufferValue:
    if not isinstance(blocks, BufferValue):
        raise TypeError(f"blocks must be a BufferValue (a mutable graph input), got {type(blocks).__name__}")
    check_dtype("blocks", blocks, kv_params.dtype)
    check_rank("blocks", blocks, 6)
    check_static_dim("blocks", blocks, 1, 2)
    check_static_dim("blocks", blocks, 4, kv_params.n_kv_heads_per_device)
    check_static_dim("blocks", blocks, 5, kv_params.head_dim)
    if num_layers is not None:
        check_static_dim("blocks", blocks, 2, num_layers)
    return blocks


class _Fetch:
    """Checks the flat cache inputs and emits the cache kind's constructor op.

    Subclasses name the op, the collection type and value, and the (name, dtype, rank)
    of the three tensors that follow `blocks`, in `mokv.inputs` order.
    """

    _op = ""
    _type: type[Any] = object
    _value: type[Any] = object
    _tensors: tuple[tuple[str, DType, int], ...] = ()

    def __init__(self, kv_params: KVCacheParams, num_layers: int | None = None) -> None:
        if not isinstance(kv_params, KVCacheParams):
            raise TypeError(f"kv_params must be a KVCacheParams, got {type(kv_params).__name__}")
        if num_layers is not None and (not isinstance(num_layers, int) or num_layers < 1):
            raise ValueError(f"num_layers must be a positive int or None, got {num_layers!r}")
        dtype_code(kv_params.dtype)  # fail at construction for an unsupported dtype
        self.kv_params = kv_params
        self.num_layers = num_layers

    def _check_layout(self, blocks: BufferValue) -> None:
        """Checks of `blocks` specific to the cache kind (none by default)."""

    def __call__(self, *inputs: Any) -> Any:
        blocks, *tensors = _unpack(inputs, type(self).__name__)
        blocks = _check_blocks(blocks, self.kv_params, self.num_layers)
        self._check_layout(blocks)
        for (name, dtype, rank), value in zip(self._tensors, tensors):
            check_dtype(name, value, dtype)
            check_rank(name, value, rank)
        out_type = self._type(self.kv_params)
        value = ops.inplace_custom(
            self._op,
            blocks.device,
            [blocks, *(TensorValue(t) for t in tensors)],
            out_types=[out_type],
            parameters=dict(out_type.parameters),
        )[0]
        return self._value(value)


class FetchContinuousBatchingKVCacheCollection(_Fetch):
    """Builds a `ContinuousBatchingKVCacheCollection` from `continuous_input_symbols` values.

    Args (call): blocks [max_batch_size, 2, num_layers, max_seq_len, n_kv_heads, head_dim]
    (BufferValue), cache_lengths uint32 [batch_size], lookup_table uint32 [batch_size],
    is_cache_empty bool [1] (host); or one `ContinuousBatchingKVCacheInputs`.
    """

    _op = "mokv.kv_collection_ctor.continuous"
    _type = ContinuousBatchingKVCacheCollectionType
    _value = ContinuousBatchingKVCacheCollection
    _tensors = (
        ("cache_lengths", DType.uint32, 1),
        ("lookup_table", DType.uint32, 1),
        ("is_cache_empty", DType.bool, 1),
    )


class FetchPagedKVCacheCollection(_Fetch):
    """Builds a `PagedKVCacheCollection` from `paged_input_symbols` values.

    Args (call): blocks [total_num_pages, 2, num_layers, page_size, n_kv_heads, head_dim]
    (BufferValue), cache_lengths uint32 [batch_size], lookup_table uint32
    [batch_size, max_num_pages], max_lengths uint32 [num_steps, 2] (host); or one
    `RaggedKVCacheInputs`.
    """

    _op = "mokv.kv_collection_ctor.paged"
    _type = PagedKVCacheCollectionType
    _value = PagedKVCacheCollection
    _tensors = (
        ("cache_lengths", DType.uint32, 1),
        ("lookup_table", DType.uint32, 2),
        ("max_lengths", DType.uint32, 2),
    )

    def _check_layout(self, blocks: BufferValue) -> None:
        check_static_dim("blocks", blocks, 3, self.kv_params.page_size)


__all__ = [
    "ContinuousBatchingKVCacheInputs",
    "FetchContinuousBatchingKVCacheCollection",
    "FetchPagedKVCacheCollection",
    "RaggedKVCacheInputs",
]
