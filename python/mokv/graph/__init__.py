"""Graph-side cache types (seed 002): opaque collection types/values and their fetchers."""

from .fetch import FetchContinuousBatchingKVCacheCollection, FetchPagedKVCacheCollection
from .types import (
    DTYPE_CODES,
    ContinuousBatchingKVCache,
    ContinuousBatchingKVCacheCollection,
    ContinuousBatchingKVCacheCollectionType,
    ContinuousBatchingKVCacheType,
    PagedKVCacheCollection,
    PagedKVCacheCollectionType,
)

__all__ = [
    "DTYPE_CODES",
    "ContinuousBatchingKVCache",
    "ContinuousBatchingKVCacheCollection",
    "ContinuousBatchingKVCacheCollectionType",
    "ContinuousBatchingKVCacheType",
    "FetchContinuousBatchingKVCacheCollection",
    "FetchPagedKVCacheCollection",
    "PagedKVCacheCollection",
    "PagedKVCacheCollectionType",
]
