"""Cache layouts: what crosses the graph boundary for each cache kind (see `base`).

Every place that depends on the cache kind asks its layout: a manager holds one
(`manager.layout`), op wrappers find it from a collection value (`collection_info`),
and graph builders from the input symbols (`layout_of_inputs`).
"""

from __future__ import annotations

from typing import Any

from max.graph.value import _OpaqueValue

from ..config.params import KVCacheParams, KVCacheStrategy
from .base import DTYPE_CODES, CacheLayout, CollectionInfo, FetchKVCacheCollection, dtype_code
from .continuous import (
    CONTINUOUS,
    ContinuousBatchingKVCache,
    ContinuousBatchingKVCacheCollection,
    ContinuousBatchingKVCacheCollectionType,
    ContinuousBatchingKVCacheInputs,
    ContinuousBatchingKVCacheType,
    FetchContinuousBatchingKVCacheCollection,
    ScaledContinuousBatchingKVCacheInputs,
)
from .paged import (
    PAGED,
    FetchPagedKVCacheCollection,
    PagedKVCacheCollection,
    PagedKVCacheCollectionType,
    RaggedKVCacheInputs,
    ScaledRaggedKVCacheInputs,
)

LAYOUTS: dict[str, CacheLayout] = {PAGED.name: PAGED, CONTINUOUS.name: CONTINUOUS}
"""Every layout, by name (= its `KVCacheStrategy` value)."""


def layout_for(params: KVCacheParams | KVCacheStrategy | str) -> CacheLayout:
    """The layout that `params.cache_strategy` (or a strategy, or its name) names."""
    strategy = params.cache_strategy if isinstance(params, KVCacheParams) else params
    try:
        return LAYOUTS[KVCacheStrategy(strategy).value]
    except ValueError:
        raise ValueError(f"unknown cache strategy {strategy!r}; valid: {sorted(LAYOUTS)}") from None


def layout_of_inputs(inputs: Any) -> CacheLayout:
    """The layout whose `Inputs` tuple `inputs` is (symbols or buffers)."""
    for layout in LAYOUTS.values():
        if isinstance(inputs, (layout.Inputs, layout.ScaledInputs)):
            return layout
    raise TypeError(
        "expected one device's cache inputs as a manager's input_symbols() or fetch() returns "
        f"them ({', '.join(layout.Inputs.__name__ for layout in LAYOUTS.values())}), "
        f"got {type(inputs).__name__}"
    )


def collection_info(name: str, value: Any) -> CollectionInfo:
    """The layout and static shape of a mokv collection value; TypeError for anything else."""
    if not isinstance(value, _OpaqueValue):
        raise TypeError(f"{name} must be a KV cache collection value, got {type(value).__name__}")
    for layout in LAYOUTS.values():
        if value.type.name == layout.Collection.__name__:
            return layout.info(value)
    raise TypeError(f"{name} must be a mokv cache collection, got opaque type {value.type.name!r}")


__all__ = [
    "CONTINUOUS",
    "DTYPE_CODES",
    "LAYOUTS",
    "PAGED",
    "CacheLayout",
    "CollectionInfo",
    "ContinuousBatchingKVCache",
    "ContinuousBatchingKVCacheCollection",
    "ContinuousBatchingKVCacheCollectionType",
    "ContinuousBatchingKVCacheInputs",
    "ContinuousBatchingKVCacheType",
    "FetchContinuousBatchingKVCacheCollection",
    "FetchKVCacheCollection",
    "FetchPagedKVCacheCollection",
    "PagedKVCacheCollection",
    "PagedKVCacheCollectionType",
    "RaggedKVCacheInputs",
    "ScaledContinuousBatchingKVCacheInputs",
    "ScaledRaggedKVCacheInputs",
    "collection_info",
    "dtype_code",
    "layout_for",
    "layout_of_inputs",
]
