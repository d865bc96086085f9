"""The paged KV cache manager: fixed-size pages, a prefix cache, tiers, replicas.

manager.py  PagedKVCacheManager: routing between data-parallel replicas, the contract
replica.py  PagedReplica: one replica's requests, driving its parts below
replica_parts.py  build_replica_parts: a replica's groups, tiers, sessions and pins,
            built from the params (all or nothing: what it opened is closed)
groups/     the cache groups: the protocol (base.py) and one module per kind (full.py)
plans.py    what a replica holds per request, and its calls' plans
planner.py  ReservationPlanner: a reservation's hits and fresh pages, as a value
take.py     ReservationTaker: a batch of planned reservations taken, all or nothing
commit.py   plan_commit, PageCommitter: the pages a step filled, hashed and indexed
loads.py    PendingLoads: tier hits reserved on requests, loaded before the graph
batch_inputs.py  BatchInputs: a batch's graph inputs, and the prompt tokens they process
prefix.py   PrefixChains: where a request's hash chain is rooted, its device hits
chain_memo.py  each request's hash chain kept across its calls, with its last hits
sessions.py SessionTable: the hash chains open sessions retain, until when
chain_counts.py  hash chains held by several holders, counted per hash (sessions, pins)
pins.py     PinTable: the prefixes pinned with a time to live, within a budget
inputs.py   the page table, and the per-device graph inputs it gives
sizing.py   memory sizing (MAX's classmethods call it)
metrics.py  occupancy and counters (MAX's metric members read them)
multistep.py  MAX's multistep and data-parallel helpers
"""

from .manager import PagedKVCacheManager
from .pins import PinGrant
from .replica import PagedReplica

__all__ = ["PagedKVCacheManager", "PagedReplica", "PinGrant"]
