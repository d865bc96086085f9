"""A paged replica's tiers beside its device pool: loading tier hits into device pages,
and what the replica does to its pool and tiers together (metrics, events, reset, close).

A mixin of `PagedReplica` (replica.py says how a tier hit becomes a pending load).
"""

from __future__ import annotations

from collections.abc import Callable

from ...cache.page_pool import PagePool
from ...context import RequestID, TextGenerationContext
from ...errors import InvariantError
from ...events.publisher import EventRecorder
from ...tiers.stack import TierStack
from ...undo import UndoLog
from .plans import RequestState
from .sessions import SessionTable


class ReplicaTiers:
    """The tier half of `PagedReplica` (a mixin over its pool, requests and tiers)."""

    pool: PagePool
    tiers: TierStack
    undo: UndoLog
    sessions: SessionTable | None
    input_tokens: int
    cache_tokens: int
    _requests: dict[RequestID, RequestState]
    # `ReplicaCommits._share_duplicates`: the request holding a page another already
    # indexed moves onto that one (loads go through the same sharing as commits).
    _share_duplicates: Callable[
        [list[tuple[RequestState, int]], list[int], list[bytes], list[bool]], None
    ]

    def load_pending(self, batch: list[TextGenerationContext]) -> None:
        """Copies the tier hits of `batch`'s requests into their device pages (one batch
        per tier and device), then indexes those pages on the device and unpins the
        hits. All or nothing: the copies only write pages the requests own, so a failure
        before the index changes leaves the loads pending, to run again."""
        reqs = [self._requests[ctx.request_id] for ctx in batch]
        pending = [load for req in reqs for load in req.loads]
        if not pending:
            return
        loads = self.tiers.load(pending)
        hashes = [ld.hit.page_hash for ld in loads]
        datas = [ld.hit.token_bytes for ld in loads]
        indexed = self.pool.commit_pages(
            [ld.page for ld in loads],
            hashes,
            datas,
            [ld.parent_hash for ld in loads],
            [ld.keys for ld in loads],
        )
        # A page loaded while another request committed the same prefix on the device.
        owner = {page: (req, idx) for req in reqs for idx, page in enumerate(req.pages)}
        self._share_duplicates([owner[ld.page] for ld in loads], hashes, datas, indexed)
        for req in reqs:
            if req.loads:
                self.undo.push(req.loads.extend, list(req.loads))  # onto the emptied list
                req.loads.clear()
        self.tiers.unpin(loads)

    def reset_metrics(self) -> None:
        self.input_tokens = self.cache_tokens = self.pool.num_evicted_retained = 0
        self.tiers.reset_metrics()
        if self.sessions is not None:
            self.sessions.reset_metrics()

    def publish_to(self, events: EventRecorder) -> None:
        """Reports the pool's and the tiers' changes to `events` (the replica's stream)."""
        events.undo = self.undo
        self.pool.events = events
        self.tiers.publish_to(events)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix in the pool and the tiers (pending loads still
        complete)."""
        self.pool.reset_prefix_cache()
        self.tiers.reset()
        if self.sessions is not None:
            self.sessions.clear()

    def close(self) -> None:
        """Closes the tiers (they send what they queued, a bounded wait)."""
        self.tiers.close()

    def check_loads(self) -> None:
        """InvariantError unless every pending load writes a page its request owns
        without a hash, and each tier holds exactly the pending loads' hits pinned, each
        still holding its tokens (`Tier.check_invariants`)."""
        for request_id, req in self._requests.items():
            for load in req.loads:
                page = load.page
                if page not in req.pages or self.pool.page_hash(page) is not None:
                    raise InvariantError(
                        f"request {request_id!r} loads into device page {page}, which it "
                        "does not own or which is hashed"
                    )
        self.tiers.check_invariants([ld for req in self._requests.values() for ld in req.loads])
