"""mokv: KV-cache managers, graph types and Mojo kernels for Modular MAX.

The layers, top to bottom:

    a scheduler / model runner
      -> the manager contract (`KVCacheManager`: managers/base.py)
      -> a manager (paged: one `PagedReplica` per data-parallel replica -> `PagePool`;
         continuous: one slot per request; null: compile-only)
    the graph boundary: the manager's `layout` (`mokv.layouts`) names the flat inputs
      -> a fetcher turns them into an opaque Mojo collection value inside the graph
      -> the kernels (`mokv.ops`, mojo/mokv/) read and write the cache through it
"""

from .compiler_output import filter_collection_warnings
from .context import RequestID, TextContext, TextGenerationContext
from .errors import (
    AlreadyClaimedError,
    BatchTooLargeError,
    InsufficientMemoryError,
    InsufficientPagesError,
    InvalidReplicaError,
    InvariantError,
    MokvError,
    SequenceTooLongError,
    StaleContextError,
    UnknownRequestError,
)
from .layouts import (
    CONTINUOUS,
    PAGED,
    CacheLayout,
    ContinuousBatchingKVCacheInputs,
    FetchContinuousBatchingKVCacheCollection,
    FetchKVCacheCollection,
    FetchPagedKVCacheCollection,
    RaggedKVCacheInputs,
    layout_for,
    layout_of_inputs,
)
from .events.config import KVEventsConfig
from .managers.base import KVCacheManager
from .managers.continuous import ContinuousKVCacheManager
from .managers.loader import load_kv_manager
from .managers.mojo_continuous import MojoContinuousBatchingKVCacheManager
from .managers.null import NullKVCacheManager
from .managers.paged import PagedKVCacheManager
from .managers.sequences import ContinuousBatchingKVCacheManager
from .metrics import KVCacheMetrics
from .params import KVCacheParams, KVCacheStrategy

__all__ = [
    "KVEventsConfig",
    "CONTINUOUS",
    "PAGED",
    "AlreadyClaimedError",
    "BatchTooLargeError",
    "CacheLayout",
    "ContinuousBatchingKVCacheInputs",
    "ContinuousBatchingKVCacheManager",
    "ContinuousKVCacheManager",
    "FetchContinuousBatchingKVCacheCollection",
    "FetchKVCacheCollection",
    "FetchPagedKVCacheCollection",
    "InsufficientMemoryError",
    "InsufficientPagesError",
    "InvalidReplicaError",
    "InvariantError",
    "KVCacheManager",
    "KVCacheMetrics",
    "KVCacheParams",
    "KVCacheStrategy",
    "MojoContinuousBatchingKVCacheManager",
    "MokvError",
    "NullKVCacheManager",
    "PagedKVCacheManager",
    "RaggedKVCacheInputs",
    "RequestID",
    "SequenceTooLongError",
    "StaleContextError",
    "TextContext",
    "TextGenerationContext",
    "UnknownRequestError",
    "filter_collection_warnings",
    "layout_for",
    "layout_of_inputs",
    "load_kv_manager",
]
