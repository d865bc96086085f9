"""The continuous-batching layout: one contiguous `max_seq_len` slot per sequence.

One device's inputs (`ContinuousBatchingKVCacheInputs`, in constructor-op order):

    blocks         dtype  [max_batch_size, 2, num_layers, max_seq_len, n_kv_heads_per_device,
                          head_dim]: one slot per sequence; token `t` of sequence `b` lives at
                          `blocks[lookup_table[b], kv, layer, t]`.
    cache_lengths  uint32 [batch_size]   tokens already in the cache before this step
    lookup_table   uint32 [batch_size]   slot of each sequence of the batch
    is_cache_empty bool   [1] on the host: True when every cache length is 0.
                          Carried for compatibility with MAX's continuous-batching
                          signature; mokv's kernels read `cache_lengths` instead.

A cache of scaled FP8 pages (`KVCacheParams.quantization`) has one more input, last
(`ScaledContinuousBatchingKVCacheInputs`):

    scales         float32 [max_batch_size, 2, num_layers, max_seq_len,
                          n_kv_heads_per_device, head_dim // granularity]: the scales of
                          the values in `blocks`, slot by slot.

Mojo side: `ContinuousBatchingKVCacheCollection` in mojo/mokv/continuous.mojo.
"""

from __future__ import annotations

from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np
from max.driver import Buffer
from max.dtype import DType
from max.graph import BufferType, DeviceRef, TensorType
from max.graph.type import _OpaqueType
from max.graph.value import _OpaqueValue

from ..config.params import KVCacheParams
from .base import CacheLayout, FetchKVCacheCollection, KVCollectionValue, TensorSpec

T = TypeVar("T")
B = TypeVar("B")


class ContinuousBatchingKVCacheInputs(NamedTuple, Generic[B, T]):
    """One device's continuous-batching inputs: `Buffer`s at run time, types at graph build."""

    blocks: B
    cache_lengths: T
    lookup_table: T
    is_cache_empty: T


class ScaledContinuousBatchingKVCacheInputs(NamedTuple, Generic[B, T]):
    """One device's inputs of a continuous cache of scaled pages: the inputs and the
    scales leaf (module docstring)."""

    blocks: B
    cache_lengths: T
    lookup_table: T
    is_cache_empty: T
    scales: B


class ContinuousBatchingKVCacheCollectionType(_OpaqueType):
    """Graph type of the K/V view over every layer of a continuous-batching cache.

    The value does not own the cache memory: it points into the manager's buffers.
    """

    def __init__(self, kv_params: KVCacheParams) -> None:
        super().__init__(
            "ContinuousBatchingKVCacheCollection", CONTINUOUS.collection_parameters(kv_params)
        )


class ContinuousBatchingKVCacheCollection(KVCollectionValue):
    """Graph value of a `ContinuousBatchingKVCacheCollectionType`."""


class ContinuousBatchingKVCacheType(_OpaqueType):
    """Graph type of ONE layer's K or V cache (Mojo `ContinuousBatchingKVCache`).

    Part of MAX's continuous-batching API; no mokv op produces or consumes it: kernels
    take the collection plus a `layer_idx`.
    """

    def __init__(self, kv_params: KVCacheParams) -> None:
        super().__init__("ContinuousBatchingKVCache", CONTINUOUS.collection_parameters(kv_params))


class ContinuousBatchingKVCache(_OpaqueValue):
    """Graph value of a `ContinuousBatchingKVCacheType`."""


class ContinuousLayout(CacheLayout):
    name = "continuous"
    Inputs = ContinuousBatchingKVCacheInputs
    ScaledInputs = ScaledContinuousBatchingKVCacheInputs
    CollectionType = ContinuousBatchingKVCacheCollectionType
    Collection = ContinuousBatchingKVCacheCollection
    tensors = (
        TensorSpec("cache_lengths", DType.uint32, 1),
        TensorSpec("lookup_table", DType.uint32, 1),
        TensorSpec("is_cache_empty", DType.bool, 1),
    )

    def input_symbols(
        self,
        params: KVCacheParams,
        num_layers: int,
        max_seq_len: int,
        device: DeviceRef,
        dim_prefix: str = "",
    ) -> Any:
        """Graph types of one device's inputs (`ScaledInputs` for scaled pages);
        `max_seq_len` is a static dim of `blocks`."""
        batch = dim_prefix + "batch_size"
        blocks_shape = [
            "max_batch_size",
            2,
            num_layers,
            max_seq_len,
            params.n_kv_heads_per_device,
            params.head_dim,
        ]
        inputs = ContinuousBatchingKVCacheInputs(
            blocks=BufferType(params.dtype, blocks_shape, device=device),
            cache_lengths=TensorType(DType.uint32, [batch], device=device),
            lookup_table=TensorType(DType.uint32, [batch], device=device),
            is_cache_empty=TensorType(DType.bool, [1], device=DeviceRef.CPU()),
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
    ) -> Any:
        """Zero slots."""
        shape = (0, 2, num_layers, max_seq_len, params.n_kv_heads_per_device, params.head_dim)
        inputs = ContinuousBatchingKVCacheInputs(
            blocks=Buffer(params.dtype, shape),
            cache_lengths=Buffer(DType.uint32, (batch_size,)),
            lookup_table=Buffer(DType.uint32, (batch_size,)),
            is_cache_empty=Buffer.from_numpy(np.ones(1, dtype=np.bool_)),
        )
        return self.with_scales(params, inputs, shape, Buffer)


CONTINUOUS = ContinuousLayout()


class FetchContinuousBatchingKVCacheCollection(FetchKVCacheCollection):
    """Builds a `ContinuousBatchingKVCacheCollection` from one device's
    `ContinuousBatchingKVCacheInputs` values: blocks (a BufferValue), cache_lengths,
    lookup_table, is_cache_empty (shapes above)."""

    layout = CONTINUOUS
