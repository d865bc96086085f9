"""mokv: KV-cache managers, graph types and Mojo kernels for Modular MAX.

The host side (this package's managers) owns the cache memory and describes a batch
to the graph with flat tensors (`mokv.inputs`); inside the graph, Mojo cache structs
read and write that memory (`mokv.graph`, `mokv.ops`).
"""

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
    UnknownRequestError,
)
from .inputs import ContinuousBatchingKVCacheInputs, RaggedKVCacheInputs
from .managers.continuous import ContinuousBatchingKVCacheManager
from .managers.loader import load_kv_manager
from .managers.mojo_continuous import MojoContinuousBatchingKVCacheManager
from .managers.null import NullKVCacheManager
from .managers.paged import PagedKVCacheManager
from .metrics import KVCacheMetrics
from .params import KVCacheParams, KVCacheStrategy

__all__ = [
    "AlreadyClaimedError",
    "BatchTooLargeError",
    "ContinuousBatchingKVCacheInputs",
    "ContinuousBatchingKVCacheManager",
    "InsufficientMemoryError",
    "InsufficientPagesError",
    "InvalidReplicaError",
    "InvariantError",
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
    "TextContext",
    "TextGenerationContext",
    "UnknownRequestError",
    "load_kv_manager",
]
