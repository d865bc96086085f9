"""The paged manager's occupancy and counters: MAX's metric members, all replicas together.

Token counts come from the replicas (`input_tokens`, `cache_tokens`) and their tiers
(`KVCacheMetrics.tiers`, one entry per tier name, summed over the replicas); page
counts from the pools. The shared tier's stores keep their own counters
(`remote_metrics`), which they update from their writer threads.
"""

from __future__ import annotations

import threading

from max.driver import Buffer

from ...metrics import KVCacheMetrics, SessionMetrics, TierMetrics
from ...remote import RemoteMetrics
from ...tiers.remote import RemoteTier
from ..base import synchronized
from .replica import PagedReplica
from .routing import replica_index


class PagedMetrics:
    """Occupancy and counters over `self.replicas` (a mixin of `PagedKVCacheManager`)."""

    replicas: list[PagedReplica]
    total_num_pages: int
    _lock: threading.RLock

    @property
    @synchronized
    def num_free_blocks(self) -> int:
        """Pages that can be handed out now (cached-free pages included), all replicas."""
        return sum(r.pool.num_free for r in self.replicas)

    @synchronized
    def page_counts(self, replica_idx: int) -> tuple[int, int]:
        """(free, total) pages of one replica: free counts cached-free pages too."""
        pool = self.replicas[replica_index(replica_idx, len(self.replicas))].pool
        return pool.num_free, pool.num_pages

    @synchronized
    def device_buffers(self, replica_idx: int) -> list[Buffer]:
        """One replica's page buffers, one per device (`[pages, 2, layers, page_size,
        kv_heads_per_device, head_dim]`): what `fetch` hands the graph as `blocks`."""
        return list(self.replicas[replica_index(replica_idx, len(self.replicas))].blocks)

    @property
    def free_blocks_pct(self) -> float:
        """Fraction (0.0-1.0) of all pages that are free or cached-free."""
        return self.num_free_blocks / self.total_num_pages

    @property
    def used_blocks_pct(self) -> float:
        """Fraction (0.0-1.0) of all pages owned by requests."""
        return 1.0 - self.free_blocks_pct

    @property
    @synchronized
    def metrics(self) -> KVCacheMetrics:
        tiers: dict[str, TierMetrics] = {}
        sessions = SessionMetrics()
        for replica in self.replicas:
            for name, metrics in replica.tiers.metrics():
                tiers[name] = tiers.get(name, TierMetrics()) + metrics
            if replica.sessions is not None:
                sessions += replica.sessions.metrics()
        return KVCacheMetrics(
            input_tokens=sum(r.input_tokens for r in self.replicas),
            cache_tokens=sum(r.cache_tokens for r in self.replicas),
            used_pages=sum(r.pool.num_used for r in self.replicas),
            free_pages=self.num_free_blocks,
            tiers=tiers,
            sessions=sessions,
        )

    @property
    def remote_metrics(self) -> RemoteMetrics:
        """The shared tier's own counters, summed over every store (one per device shard
        per replica, so with tensor parallelism each page counts once per shard): hits,
        misses, rejected values, bytes each way, errors, timeouts, drops. All zero with
        the tier off. The stores count from their own threads, so this is not locked."""
        tiers = (t for r in self.replicas for t in r.tiers if isinstance(t, RemoteTier))
        return sum((tier.store_metrics() for tier in tiers), RemoteMetrics())

    @property
    def total_num_host_pages(self) -> int:
        """Pages of the host-memory tier, all replicas (0 with the tier off)."""
        return self.metrics.host_total_pages

    @property
    def host_committed_block_pct(self) -> float:
        """Fraction (0.0-1.0) of host pages holding a committed prefix."""
        metrics = self.metrics
        total = metrics.host_total_pages
        return metrics.host_used_pages / total if total else 0.0

    @synchronized
    def reset_metrics(self) -> None:
        for r in self.replicas:
            r.reset_metrics()
