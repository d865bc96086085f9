"""The tensors that carry a KV cache across a graph boundary, and their layouts.

Only flat tensors cross a graph's inputs: a manager's `fetch` / `get_runtime_inputs`
returns one tuple of `max.driver.Buffer`s per device, and its `input_symbols` /
`get_symbolic_inputs` returns the same tuple of `BufferType` / `TensorType`s. Inside the
graph, `FetchPagedKVCacheCollection` / `FetchContinuousBatchingKVCacheCollection` turn
the tuple into an opaque Mojo collection value. The field order below is the argument
order of those constructor ops.

Paged layout (`RaggedKVCacheInputs`), per device:

    blocks        dtype   [total_num_pages, 2, num_layers, page_size, n_kv_heads_per_device, head_dim]
                          index 1 selects K (0) or V (1); a page holds `page_size`
                          consecutive tokens of one sequence, for every layer.
    cache_lengths uint32  [batch_size]   tokens already in the cache before this step
    lookup_table  uint32  [batch_size, max_num_pages]   page ids of each sequence, in
                          order; token `t` of sequence `b` lives in page
                          `lookup_table[b, t // page_size]` at row `t % page_size`.
                          Entries past a sequence's pages are 0 and never read.
    max_lengths   uint32  [num_steps, 2] on the host; row `s` holds
                          (max tokens processed by one sequence in step s,
                           max cache length before step s).

Continuous-batching layout (`ContinuousBatchingKVCacheInputs`), per device:

    blocks         dtype  [max_batch_size, 2, num_layers, max_seq_len, n_kv_heads_per_device, head_dim]
                          one slot per sequence; token `t` of sequence `b` lives at
                          `blocks[lookup_table[b], kv, layer, t]`.
    cache_lengths  uint32 [batch_size]   tokens already in the cache before this step
    lookup_table   uint32 [batch_size]   slot of each sequence of the batch
    is_cache_empty bool   [1] on the host: True when every cache length is 0 (a pure
                          context-encoding batch)
"""

from __future__ import annotations

from typing import Generic, NamedTuple, TypeVar

from max.dtype import DType
from max.graph import BufferType, DeviceRef, TensorType

from .params import KVCacheParams

T = TypeVar("T")
B = TypeVar("B")


class RaggedKVCacheInputs(NamedTuple, Generic[B, T]):
    """One device's paged-cache inputs: `Buffer`s at run time, types at graph build."""

    blocks: B
    cache_lengths: T
    lookup_table: T
    max_lengths: T


class ContinuousBatchingKVCacheInputs(NamedTuple, Generic[B, T]):
    """One device's continuous-batching inputs: `Buffer`s at run time, types at graph build."""

    blocks: B
    cache_lengths: T
    lookup_table: T
    is_cache_empty: T


def paged_input_symbols(
    params: KVCacheParams, num_layers: int, device: DeviceRef
) -> RaggedKVCacheInputs[BufferType, TensorType]:
    """Graph input types of one device of a paged cache (layout in the module docstring)."""
    return RaggedKVCacheInputs(
        blocks=BufferType(
            params.dtype,
            [
                "total_num_pages",
                2,
                num_layers,
                params.page_size,
                params.n_kv_heads_per_device,
                params.head_dim,
            ],
            device=device,
        ),
        cache_lengths=TensorType(DType.uint32, ["batch_size"], device=device),
        lookup_table=TensorType(DType.uint32, ["batch_size", "max_num_pages"], device=device),
        max_lengths=TensorType(DType.uint32, ["steps_remaining", 2], device=DeviceRef.CPU()),
    )


def continuous_input_symbols(
    params: KVCacheParams, num_layers: int, max_seq_len: int, device: DeviceRef
) -> ContinuousBatchingKVCacheInputs[BufferType, TensorType]:
    """Graph input types of one device of a continuous-batching cache."""
    return ContinuousBatchingKVCacheInputs(
        blocks=BufferType(
            params.dtype,
            [
                "max_batch_size",
                2,
                num_layers,
                max_seq_len,
                params.n_kv_heads_per_device,
                params.head_dim,
            ],
            device=device,
        ),
        cache_lengths=TensorType(DType.uint32, ["batch_size"], device=device),
        lookup_table=TensorType(DType.uint32, ["batch_size"], device=device),
        is_cache_empty=TensorType(DType.bool, [1], device=DeviceRef.CPU()),
    )
