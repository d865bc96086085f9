"""The paged manager's occupancy and counters: MAX's metric members, all replicas together.

Token counts come from the replicas (`input_tokens`, `cache_tokens`) and their tiers
(`KVCacheMetrics.tiers`, one entry per tier name, summed over the replicas); page
counts from the pools. The shared tier's stores keep their own counters
(`remote_metrics`), which they update from their writer threads. Pure functions of the
replicas: the manager's properties call them under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...metrics import CacheControlMetrics, KVCacheMetrics, SessionMetrics, TierMetrics
from ...remote import RemoteMetrics
from ...tiers.remote import RemoteTier
from .replica import PagedReplica


def num_free_pages(replicas: Sequence[PagedReplica]) -> int:
    """Pages that can be handed out now (cached-free pages included), all replicas."""
    return sum(r.num_free_pages for r in replicas)


def cache_metrics(replicas: Sequence[PagedReplica]) -> KVCacheMetrics:
    """The replicas' pages, tokens, tiers and sessions, summed."""
    tiers: dict[str, TierMetrics] = {}
    sessions, control = SessionMetrics(), CacheControlMetrics()
    for replica in replicas:
        control.withheld_pages += replica.withheld_pages
        if replica.pins is not None:
            control += replica.pins.metrics()
        for stack in replica.group_tiers:  # a cache of groups: each group's tiers
            for name, metrics in stack.metrics():
                tiers[name] = tiers.get(name, TierMetrics()) + metrics
        if replica.sessions is not None:
            sessions += replica.sessions.metrics()
    return KVCacheMetrics(
        input_tokens=sum(r.input_tokens for r in replicas),
        cache_tokens=sum(r.cache_tokens for r in replicas),
        used_pages=sum(r.num_pages - r.num_free_pages for r in replicas),
        free_pages=num_free_pages(replicas),
        tiers=tiers,
        sessions=sessions,
        cache_control=control,
    )


def shared_tier_metrics(replicas: Sequence[PagedReplica]) -> RemoteMetrics:
    """The shared tier's own counters, summed over every store (one per device shard
    per replica, so with tensor parallelism each page counts once per shard): hits,
    misses, rejected values, bytes each way, errors, timeouts, drops; a recurrent
    state's checkpoints' stores included (each checkpoint a value per shard). All zero
    with the tier off. The stores count from their own threads, so this takes no lock."""
    tiers = (
        t for r in replicas for stack in r.group_tiers for t in stack if isinstance(t, RemoteTier)
    )
    pages = sum((tier.store_metrics() for tier in tiers), RemoteMetrics())
    states = (r.states.shared for r in replicas if r.states is not None)
    return sum((shared.metrics() for shared in states if shared is not None), pages)
