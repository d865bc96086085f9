"""KV-cache events in vLLM's wire format: publisher, subscriber and a router's prefix index
(their config, `KVEventsConfig`, is `mokv.config.events`).

format.py      vLLM's msgspec structs (map and legacy array forms), the batch decoder
publisher.py   EventRecorder (a page pool's sink), build_events, EventPublisher (a
               recorder with a PUB socket, a publisher thread and a replay ROUTER)
subscriber.py  EventSubscriber: SUB + DEALER replay, gap and restart detection
index.py       PrefixRouterIndex: per source (server x replica) and tier, the cached
               hashes; the leading pages of a token sequence each source holds, and
               their score by tier (device 1.0, host 0.75, shared 0.25), with the
               shared tier asked what it holds (SharedPresence)
"""

from ..config.events import KVEventsConfig
from .format import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from .index import PrefixRouterIndex, SharedPresence
from .publisher import EventPublisher, EventRecorder, build_events
from .subscriber import EventSubscriber

__all__ = [
    "AllBlocksCleared",
    "BatchDecoder",
    "BlockRemoved",
    "BlockStored",
    "EventPublisher",
    "EventRecorder",
    "EventSubscriber",
    "KVEventBatch",
    "KVEventsConfig",
    "PrefixRouterIndex",
    "SharedPresence",
    "build_events",
]
