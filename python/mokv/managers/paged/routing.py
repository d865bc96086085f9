"""Which data-parallel replica holds a request, and which one a new request should go to.

A mixin of `PagedKVCacheManager`: `_replica_of` maps each claimed request to its
replica's index; a new request goes where its prompt's longest cached prefix is, among
the replicas with a free request slot (`_recommend`).
"""

from __future__ import annotations

import threading

from ...context import RequestID, TextGenerationContext
from ...errors import InvalidReplicaError, UnknownRequestError
from ..base import check_request_id, synchronized
from .replica import PagedReplica


class PagedRouting:
    """Request-to-replica routing over `self.replicas` (a mixin of `PagedKVCacheManager`)."""

    replicas: list[PagedReplica]
    _replica_of: dict[RequestID, int]
    _lock: threading.RLock

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def _replica(self, request_id: RequestID) -> PagedReplica:
        return self.replicas[self._replica_index(request_id)]

    def _replica_index(self, request_id: RequestID) -> int:
        try:
            return self._replica_of[request_id]  # only str ids are ever stored
        except (KeyError, TypeError):
            check_request_id(request_id)
            raise UnknownRequestError(request_id) from None

    @synchronized
    def contains(self, request_id: RequestID) -> bool:
        check_request_id(request_id)
        return request_id in self._replica_of

    @synchronized
    def get_replica(self, context: TextGenerationContext) -> int:
        return self._replica_index(context.request_id)

    @synchronized
    def prefix_hit_pages(self, context: TextGenerationContext) -> list[tuple[int, int]]:
        """Per replica, the pages of `context`'s prompt it could serve: from its device
        pages, and from its own tiers after them (MAX's `get_prefix_cache_hit_counts`;
        a shared tier is not asked). Changes nothing."""
        return [replica.prefix_hit_pages(context) for replica in self.replicas]

    @synchronized
    def get_or_recommend_replica(self, context: TextGenerationContext) -> int:
        """The request's replica if claimed; else the one `_recommend` picks for it."""
        if context.request_id in self._replica_of:
            return self._replica_of[context.request_id]
        return self._recommend(context)

    def _recommend(self, context: TextGenerationContext | None) -> int:
        """The replica for a new request: one with a free request slot while any has one
        (a full one would refuse the claim); among those the one holding the longest
        cached prefix of `context`'s tokens (mokv's addition: MAX 25.7 ignores prefixes
        here), then MAX's rule, the fewest requests, then the most free pages; the
        lowest index on a tie."""
        if self.num_replicas == 1:
            return 0

        def rank(r: int) -> tuple[bool, int, int, int]:
            replica = self.replicas[r]
            hits = sum(replica.prefix_hit_pages(context)) if context is not None else 0
            return (replica.num_free_slots > 0, hits, -replica.num_requests, replica.pool.num_free)

        return max(range(self.num_replicas), key=rank)


def replica_index(replica_idx: int, num_replicas: int) -> int:
    """`replica_idx`, checked: InvalidReplicaError unless an int in [0, num_replicas)."""
    if replica_idx.__class__ is not int or not 0 <= replica_idx < num_replicas:
        raise InvalidReplicaError(
            f"replica_idx={replica_idx!r} is out of range for {num_replicas} replica(s)"
        )
    return replica_idx
