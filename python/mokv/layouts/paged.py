"""The paged layout: fixed-size pages from one shared pool, found through a lookup table.

One device's inputs (`RaggedKVCacheInputs`, in constructor-op order):

    blocks        dtype   [total_num_pages, kv_dim, num_layers, page_size,
                          n_kv_heads_per_device, head_dim]: index 1 selects K (0) or V (1),
                          or is the one MLA latent (kv_dim 1, one head of latent_dim +
                          rope_dim); a page holds `page_size` consecutive tokens of one
                          sequence, for every layer.
    cache_lengths uint32  [batch_size]   tokens already in the cache before this step
    lookup_table  uint32  [batch_size, max_num_pages]   page ids of each sequence, in
                          order; token `t` of sequence `b` lives in page
                          `lookup_table[b, t // page_size]` at row `t % page_size`.
                          A manager's table is padded as MAX pads it, every entry a
                          valid page id (`max_paged.lookup_table_width`); mokv's
                          kernels use only a sequence's own pages, at any width.
    max_lengths   uint32  [num_steps, 2] on the host; row `s` holds MAX's (most new
                          tokens of one sequence in step s, most cache + new tokens of
                          one sequence in step s). For MAX's ops (`max_paged`, whose
                          GPU attention sizes its work by the second); mokv's kernels
                          read the per-sequence `cache_lengths` instead.

A cache of scaled FP8 pages (`KVCacheParams.quantization`) has one more input, last
(`ScaledRaggedKVCacheInputs`):

    scales        float32 [total_num_pages, kv_dim, num_layers, page_size,
                          n_kv_heads_per_device, head_dim // granularity]: the scales of
                          the values in `blocks` (MAX's scales leaf,
                          `shape_per_scale_block`), under the same page ids.

Mojo side: `PagedKVCacheCollection` in mojo/mokv/paged.mojo. MAX's own paged ops take
these inputs in MAX's form: `mokv.layouts.max_paged`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, NamedTuple, TypeVar

import numpy as np
from max.driver import Buffer
from max.dtype import DType
from max.graph import BufferType, BufferValue, DeviceRef, TensorType
from max.graph.type import _OpaqueType

from ..checks import check_static_dim
from ..config.params import KVCacheParams
from .base import CacheLayout, FetchKVCacheCollection, KVCollectionValue, TensorSpec

T = TypeVar("T")
B = TypeVar("B")
D = TypeVar("D", int, str)


def page_buffer_shape(params: KVCacheParams, num_layers: int, num_pages: D) -> list[D | int]:
    """The shape of one device's pages: `[num_pages, kv_dim, num_layers, page_size,
    n_kv_heads_per_device, head_dim]` (`num_pages` a count or a graph dim's name)."""
    return [
        num_pages,
        params.kv_dim,
        num_layers,
        params.page_size,
        params.n_kv_heads_per_device,
        params.head_dim,
    ]


class RaggedKVCacheInputs(NamedTuple, Generic[B, T]):
    """One device's paged-cache inputs: `Buffer`s at run time, types at graph build."""

    blocks: B
    cache_lengths: T
    lookup_table: T
    max_lengths: T


class ScaledRaggedKVCacheInputs(NamedTuple, Generic[B, T]):
    """One device's inputs of a cache of scaled pages: `RaggedKVCacheInputs` and the
    scales leaf (module docstring)."""

    blocks: B
    cache_lengths: T
    lookup_table: T
    max_lengths: T
    scales: B


PagedInputs = RaggedKVCacheInputs[B, T] | ScaledRaggedKVCacheInputs[B, T]
"""One device's paged inputs, with or without scales."""


class PagedKVCacheCollectionType(_OpaqueType):
    """Graph type of the K/V view over every layer of a paged cache (owns no memory)."""

    def __init__(self, kv_params: KVCacheParams) -> None:
        super().__init__("PagedKVCacheCollection", PAGED.collection_parameters(kv_params))


class PagedKVCacheCollection(KVCollectionValue):
    """Graph value of a `PagedKVCacheCollectionType`."""


class PagedLayout(CacheLayout):
    name = "paged"
    Inputs = RaggedKVCacheInputs
    ScaledInputs = ScaledRaggedKVCacheInputs
    CollectionType = PagedKVCacheCollectionType
    Collection = PagedKVCacheCollection
    tensors = (
        TensorSpec("cache_lengths", DType.uint32, 1),
        TensorSpec("lookup_table", DType.uint32, 2),
        TensorSpec("max_lengths", DType.uint32, 2),
    )

    def input_symbols(
        self,
        params: KVCacheParams,
        num_layers: int,
        max_seq_len: int,
        device: DeviceRef,
        dim_prefix: str = "",
        pages_dim: str = "total_num_pages",
    ) -> PagedInputs[BufferType, TensorType]:
        """Graph types of one device's inputs; `max_seq_len` does not appear in them.
        `pages_dim` names the pool's size (one per cache group of a manager)."""
        batch, pages, steps = (
            dim_prefix + n for n in ("batch_size", "max_num_pages", "steps_remaining")
        )
        blocks_shape = page_buffer_shape(params, num_layers, pages_dim)
        inputs = RaggedKVCacheInputs(
            blocks=BufferType(params.dtype, blocks_shape, device=device),
            cache_lengths=TensorType(DType.uint32, [batch], device=device),
            lookup_table=TensorType(DType.uint32, [batch, pages], device=device),
            max_lengths=TensorType(DType.uint32, [steps, 2], device=DeviceRef.CPU()),
        )
        return self.with_scales(
            params, inputs, blocks_shape, lambda dtype, dims: BufferType(dtype, dims, device)
        )

    def empty_inputs(
        self,
        params: KVCacheParams,
        num_layers: int,
        max_seq_len: int,
        batch_size: int,
        num_steps: int,
    ) -> PagedInputs[Buffer, Buffer]:
        """Zero pages; a one-column lookup table of zeros."""
        shape = page_buffer_shape(params, num_layers, 0)
        inputs = RaggedKVCacheInputs(
            blocks=Buffer(params.dtype, shape),
            cache_lengths=Buffer(DType.uint32, (batch_size,)),
            lookup_table=Buffer(DType.uint32, (batch_size, 1)),
            max_lengths=Buffer.from_numpy(np.zeros((num_steps, 2), dtype=np.uint32)),
        )
        return self.with_scales(params, inputs, shape, Buffer)

    def collection_parameters(self, params: KVCacheParams) -> dict[str, int]:
        return {**super().collection_parameters(params), "page_size": params.page_size}

    def check_blocks(self, blocks: BufferValue, params: KVCacheParams) -> None:
        check_static_dim("blocks", blocks, 3, params.page_size)


PAGED = PagedLayout()


def group_input_symbols(
    params: KVCacheParams, num_layers: int, max_seq_len: int, devices: Sequence[DeviceRef]
) -> list[PagedInputs[BufferType, TensorType]]:
    """The graph types of a cache of groups (`KVCacheParams.groups`), in `fetch` order:
    every group's in turn (`params.groups` order), each group's one tuple per device
    (replica by replica: device `i` is replica `i // tensor_parallel_degree`'s), as MAX
    26.7's `MultiKVCacheParams` flattens its children. Each group's tuple has its own
    pool (`<group>_total_num_pages` pages), layers, heads and head size, and its own
    per-batch dims (`<group>_batch_size`, ...; `<group>_replica_<r>_...` with several
    replicas), so that one graph takes them all."""
    dp, tp = params.data_parallel_degree, params.tensor_parallel_degree
    return [
        PAGED.input_symbols(
            params.group_params(group),
            group.num_layers,
            max_seq_len,
            device,
            dim_prefix=f"{group.name}_" + (f"replica_{i // tp}_" if dp > 1 else ""),
            pages_dim=f"{group.name}_total_num_pages",
        )
        for group in params.cache_groups(num_layers)
        for i, device in enumerate(devices)
    ]


class FetchPagedKVCacheCollection(FetchKVCacheCollection):
    """Builds a `PagedKVCacheCollection` from one device's `RaggedKVCacheInputs` values:
    blocks (a BufferValue), cache_lengths, lookup_table, max_lengths (shapes above)."""

    layout = PAGED
