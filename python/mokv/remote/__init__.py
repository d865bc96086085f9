"""A shared KV tier across servers: a content-addressed page store on Redis (issue 13).

    layout.py   RemoteLayout: the page's shape, the layout fingerprint, the key format;
                StateLayout: a recurrent state's checkpoint's (its regions)
    codec.py    PageCodec: a value's header, checksum and optional MAC tag, bound to its
                key space (`encode` / `decode`, which trusts nothing it reads)
    breaker.py  CircuitBreaker: stop asking a failing server for a while
    nodes.py    RedisNodes: one server or a Redis Cluster's masters, each with its
                breaker; a batch of commands routed by hash slot, a failure a miss
    store.py    RemotePageStore: put (queued, SET NX, pipelined, off the caller's path),
                probe / holds / lookup (pipelined chain probes), present / get
                (the pages a chain's probe finds, one page's value), RemoteMetrics

A paged replica's tier over these stores is `mokv.tiers.remote` (`RemoteTierConfig`;
the README's "Shared tier" section).
"""

from .breaker import CircuitBreaker
from .codec import PageCodec, Rejection
from .layout import RemoteLayout, StateLayout
from .store import RemoteMetrics, RemotePageStore

__all__ = [
    "CircuitBreaker",
    "PageCodec",
    "Rejection",
    "RemoteLayout",
    "RemoteMetrics",
    "RemotePageStore",
    "StateLayout",
]
