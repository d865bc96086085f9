"""KV-cache events in vLLM's wire format: publisher, subscriber and a router's prefix index.

    format.py      vLLM's msgspec structs (map and legacy array forms), the batch decoder
    config.py      KVEventsConfig (defaults as vLLM's), endpoint offsets per replica
    publisher.py   EventPublisher: a page pool's sink, a PUB socket and a replay ROUTER
    subscriber.py  EventSubscriber: SUB + DEALER replay, gap and restart detection
    index.py       PrefixRouterIndex: per source (server x replica), the cached hashes,
                   and how many leading pages of a token sequence each source holds
"""

from .config import KVEventsConfig
from .format import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from .index import PrefixRouterIndex
from .publisher import EventPublisher
from .subscriber import EventSubscriber

__all__ = [
    "AllBlocksCleared",
    "BatchDecoder",
    "BlockRemoved",
    "BlockStored",
    "EventPublisher",
    "EventSubscriber",
    "KVEventBatch",
    "KVEventsConfig",
    "PrefixRouterIndex",
]
