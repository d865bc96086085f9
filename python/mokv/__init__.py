"""mokv: KV-cache managers, graph types and Mojo kernels for Modular MAX.

The layers, top to bottom:

    configuration (`mokv.config`: the ground floor, importing nothing above it)
    a scheduler / model runner
      -> the manager contract (`KVCacheManager`: managers/base.py)
      -> a manager (paged: one `PagedReplica` per data-parallel replica -> `PagePool`,
         then its tiers (`mokv.tiers`: host memory, a shared Redis store);
         continuous: one slot per request; null: compile-only)
    the graph boundary: the manager's `layout` (`mokv.layouts`) names the flat inputs
      -> a fetcher turns them into an opaque Mojo collection value inside the graph
      -> the kernels (`mokv.ops`, mojo/mokv/) read and write the cache through it
"""

from .compiler_output import filter_collection_warnings
from .config import (
    CacheControl,
    CacheGroupConfig,
    HostTierConfig,
    KVCacheParams,
    KVCacheQuantization,
    KVCacheStrategy,
    KVEventsConfig,
    PinConfig,
    RecurrentStateConfig,
    RemoteTierConfig,
    SessionConfig,
    StateRegion,
)
from .context import MultimodalInput, RequestID, TextContext, TextGenerationContext
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
from .layouts.max_paged import max_cache_values, max_kv_params
from .managers.base import KVCacheManager
from .managers.continuous import ContinuousKVCacheManager
from .managers.loader import load_kv_manager
from .managers.mojo_continuous import MojoContinuousBatchingKVCacheManager
from .managers.null import NullKVCacheManager
from .managers.paged import PagedKVCacheManager, PinGrant
from .managers.sequences import ContinuousBatchingKVCacheManager
from .metrics import CacheControlMetrics, KVCacheMetrics, SessionMetrics, TierMetrics

__all__ = [
    "CacheControl",
    "CacheControlMetrics",
    "CONTINUOUS",
    "PAGED",
    "AlreadyClaimedError",
    "BatchTooLargeError",
    "CacheGroupConfig",
    "CacheLayout",
    "ContinuousBatchingKVCacheInputs",
    "ContinuousBatchingKVCacheManager",
    "ContinuousKVCacheManager",
    "FetchContinuousBatchingKVCacheCollection",
    "FetchKVCacheCollection",
    "FetchPagedKVCacheCollection",
    "HostTierConfig",
    "InsufficientMemoryError",
    "InsufficientPagesError",
    "InvalidReplicaError",
    "InvariantError",
    "KVCacheManager",
    "KVCacheMetrics",
    "KVCacheParams",
    "KVCacheQuantization",
    "KVCacheStrategy",
    "KVEventsConfig",
    "MojoContinuousBatchingKVCacheManager",
    "MokvError",
    "MultimodalInput",
    "NullKVCacheManager",
    "PagedKVCacheManager",
    "PinConfig",
    "PinGrant",
    "RaggedKVCacheInputs",
    "RecurrentStateConfig",
    "RemoteTierConfig",
    "RequestID",
    "SequenceTooLongError",
    "SessionConfig",
    "SessionMetrics",
    "StaleContextError",
    "StateRegion",
    "TextContext",
    "TextGenerationContext",
    "TierMetrics",
    "UnknownRequestError",
    "filter_collection_warnings",
    "layout_for",
    "layout_of_inputs",
    "load_kv_manager",
    "max_cache_values",
    "max_kv_params",
]
