"""PendingLoads: the tier hits a replica's requests reserved and have not loaded yet.

A tier hit takes a fresh device page and becomes a pending load on its request
(`PendingLoad`, `mokv.tiers.stack`), pinned in its tier from the reservation on
(`ReservationTaker`, `take.py`), so it stays loadable. `fetch` runs the pending loads of
its batch (`load`) before the graph runs and then indexes the loaded pages, so later
requests find them on the device. Releasing a request drops its pending loads
(`unpin`). With several cache groups, each load belongs to one group's tiers
(`PendingLoad.group`, `loads_by_group`).
"""

from __future__ import annotations

from ...context import RequestID
from ...errors import InvariantError
from ...undo import UndoLog
from .group_tiers import loads_by_group
from .plans import CommitPlan, RequestState
from .replica_parts import ReplicaParts


class PendingLoads:
    """The pending loads of one replica's requests, over its `parts`' groups and their
    tiers (see the module docstring); the loads themselves live on the requests
    (`RequestState.loads`)."""

    def __init__(self, parts: ReplicaParts, undo: UndoLog) -> None:
        self.groups = parts.groups
        self.group_tiers = parts.group_tiers
        self.undo = undo

    def load(self, reqs: list[RequestState]) -> None:
        """Copies the tier hits of the requests `reqs` into their device pages (one batch
        per tier and device), then indexes those pages on the device and unpins the
        hits. All or nothing: the copies only write pages the requests own, so a failure
        before the index changes leaves the loads pending, to run again."""
        pending = [load for req in reqs for load in req.loads]
        if not pending:
            return
        # Every group's copies first, then the index changes: a failing copy leaves
        # every load pending.
        by_group = [
            (g, self.group_tiers[g].load(loads))
            for g, loads in loads_by_group(pending, len(self.group_tiers))
        ]
        for g, loads in by_group:
            group = self.groups[g]
            # A page loaded while another request committed the same prefix on the
            # device is shared as a duplicate commit is (`FullAttentionGroup.commit_pages`).
            # Only the pages each request holds: a window's row below its first holds
            # the pad page (0) or pages it released, which may be others' now.
            owner = {
                row[idx]: (req, idx)
                for req in reqs
                for row in (group.row(req),)
                for idx in range(group.first(req), len(row))
            }
            group.commit_pages(
                CommitPlan(
                    [],
                    [owner[ld.page] for ld in loads],
                    [ld.page for ld in loads],
                    [ld.hit.page_hash for ld in loads],
                    [ld.hit.token_bytes for ld in loads],
                    [ld.parent_hash for ld in loads],
                    [ld.keys for ld in loads],
                )
            )
        for req in reqs:
            if req.loads:
                self.undo.push(req.loads.extend, list(req.loads))  # onto the emptied list
                req.loads.clear()
        for g, loads in by_group:
            self.group_tiers[g].unpin(loads)

    def unpin(self, req: RequestState) -> None:
        """Unpins the hits of a released request's pending loads in their tiers."""
        for g, loads in loads_by_group(req.loads, len(self.group_tiers)):
            self.group_tiers[g].unpin(loads)

    def described(self, req: RequestState) -> list[tuple[str, int, int]]:
        """(tier name, device page, page hash) of each tier hit reserved for `req` and
        not yet loaded, in chain order."""
        return [
            (self.group_tiers[ld.group].tiers[ld.tier].name, ld.page, ld.hit.page_hash)
            for ld in req.loads
        ]

    def check(self, requests: dict[RequestID, RequestState]) -> None:
        """InvariantError unless every pending load writes a page its request owns
        without a hash, and each tier holds exactly the pending loads' hits pinned, each
        still holding its tokens (`Tier.check_invariants`)."""
        for request_id, req in requests.items():
            for load in req.loads:
                page, group = load.page, self.groups[load.group]
                if page not in group.held(req) or group.pool.page_hash(page) is not None:
                    raise InvariantError(
                        f"request {request_id!r} loads into device page {page} of group "
                        f"{group.name!r}, which it does not own or which is hashed"
                    )
        pending = [ld for req in requests.values() for ld in req.loads]
        by_group = dict(loads_by_group(pending, len(self.group_tiers)))
        for g, stack in enumerate(self.group_tiers):
            stack.check_invariants(by_group.get(g, []))
