"""The paged KV cache manager: fixed-size pages, a prefix cache, tiers, replicas.

manager.py  PagedKVCacheManager: routing between data-parallel replicas, the contract
replica.py  PagedReplica: one replica's pool, buffers and requests; plan once, fits
            once, apply, commit
plans.py    what a replica holds per request, and its calls' plans
prefix.py   PrefixChains: where a request's hash chain is rooted, its device hits
chain_memo.py  each request's hash chain kept across its calls, with its last hits
sessions.py SessionTable: the hash chains open sessions retain, until when
inputs.py   the graph inputs: the page table and the per-device tuples
sizing.py   memory sizing (MAX's classmethods)
metrics.py  occupancy and counters (MAX's metric members)
"""

from .manager import PagedKVCacheManager
from .replica import PagedReplica

__all__ = ["PagedKVCacheManager", "PagedReplica"]
