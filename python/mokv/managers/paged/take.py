"""ReservationTaker: how a replica's planned reservations take their pages.

A `Reservation` (`plans.py`), planned without changing anything (`planner.py`), is
taken here: the pool's pages (hits and fresh ones, in one all-or-nothing pool call for
a batch of plans), the tier hits pinned in their tiers, the sessions a first
reservation starts and the pins its hits renew, the prompt tokens served from the
cache (`cache_tokens`, the taker's counter), each change with its undo record. Last,
each hit context moves its window past the reused tokens (`apply`).

A context's window cannot be moved back: once `apply` moved the windows of its hit
contexts, it commits the undo log (the reservation stands, and so does everything
before it in the call); a context whose own `skip_cached_prefix` raised is settled
(`_settle`): the plans whose contexts moved stand, the others are undone exactly.
"""

from __future__ import annotations

from dataclasses import replace
from operator import attrgetter, itemgetter

from ...context import TextGenerationContext
from ...errors import InvariantError
from ...undo import UndoLog
from .group_tiers import loads_by_group
from .groups import FullAttentionGroup, JointGroups
from .plans import RequestState, Reservation
from .replica_parts import ReplicaParts

_page_id, _page_hash = itemgetter(0), itemgetter(1)  # of a `(page id, hash)` hit
_num_fresh = attrgetter("num_fresh")  # of a `Reservation`


def truncate(
    group: FullAttentionGroup, req: RequestState, num_pages: int, num_hashes: int, num_loads: int
) -> None:
    """Undoes what a request's pages, hashes and loads gained, and its row of `group`'s
    page table (idempotent)."""
    del req.pages[num_pages:]
    del req.hashes[num_hashes:]
    del req.loads[num_loads:]
    group.write_row(req)


class ReservationTaker:
    """Takes one replica's reservations (see the module docstring) over its `parts`;
    `undo` is the manager's log, which the parts share."""

    def __init__(self, parts: ReplicaParts, undo: UndoLog, page_size: int) -> None:
        self.undo = undo
        self.page_size = page_size
        self.group = parts.groups[0]
        self.pool = self.group.pool
        self.tiers = parts.group_tiers[0]
        self._tiered = bool(self.tiers)  # read on every reservation
        self.group_tiers = parts.group_tiers
        self.joint = parts.joint
        self.sessions = parts.sessions
        self.pins = parts.pins
        self.cache_tokens = 0
        """Prompt tokens the reservations found cached, on the device or in a tier."""

    def fits(self, plans: list[Reservation]) -> bool:
        """Whether the pool can take every plan's hits and fresh pages at once."""
        if self.joint is not None:
            return self.joint.fits(plans)
        hit_pages = [page_id for plan in plans for page_id, _ in plan.hits]
        return self.pool.can_take(hit_pages, sum(p.num_fresh for p in plans))

    def apply(self, plans: list[Reservation]) -> None:
        """Takes the pages of `plans` (which `fits`), then moves each hit context's
        window, last, and commits the undo log (a window cannot be moved back).

        If a context's own `skip_cached_prefix` raises, the plans whose contexts moved
        stand and the others are undone exactly (`_settle`). Each tier hit takes a fresh
        device page and is pinned in its tier, so it stays loadable from the moment it
        was matched (TensorRT-LLM #12878).
        """
        mark = len(self.undo)
        self._take(plans)
        moving = [plan for plan in plans if plan.hits or plan.loads or plan.joint]
        if not moving:
            return
        try:
            for plan in moving:
                plan.ctx.skip_cached_prefix(plan.hit_tokens)
        except BaseException:
            self._settle(moving, mark)
            raise
        self.undo.commit()

    def end_overdue(self) -> bool:
        """Ends the sessions and pins past their time to live (with undo records); whether
        any ended. `_take` ends them before it evicts, and a refused reservation ends them
        and plans again (`PagedKVCacheManager.maybe_reserve`): until ended, an overdue pin
        still holds its pages out of the room, and must not refuse a request."""
        ended = False
        sessions, pins = self.sessions, self.pins
        if sessions is not None:
            retention = sessions.plan_expiry()
            if retention:
                sessions.apply(retention)
                ended = True
        if pins is not None:
            expiry = pins.plan_expiry()
            if expiry:
                pins.apply(expiry)
                ended = True
        return ended

    def _take(self, plans: list[Reservation]) -> None:
        """The pages, pins and counters of `plans`, with their undo records; no window
        moves."""
        if self.joint is not None:
            self._take_joint(self.joint, plans)
            return
        hit_pages = [page_id for plan in plans if plan.hits for page_id, _ in plan.hits]
        sessions, pins = self.sessions, self.pins
        if sessions is not None or pins is not None:
            self.end_overdue()  # before evicting
        new_pages = self.pool.take(hit_pages, sum(map(_num_fresh, plans)))
        if new_pages is None:
            raise InvariantError("a reservation that fits could not take its pages")
        fresh = list(new_pages) if self._tiered else new_pages
        firsts = [not plan.req.pages for plan in plans] if sessions is not None else []
        for plan in plans:
            req, taken = plan.req, new_pages[: plan.num_fresh]
            del new_pages[: plan.num_fresh]
            if plan.hits or plan.loads:  # `can_match`: the window starts at the hashes' end
                self.undo.push(setattr, self, "cache_tokens", self.cache_tokens)
                self.cache_tokens += plan.hit_tokens - len(req.hashes) * self.page_size
            held = len(req.pages)
            if not held and req.control is None:
                self._keep_control(req, plan.ctx)
            self.undo.push(truncate, self.group, req, held, len(req.hashes), len(req.loads))
            if plan.hits:
                req.pages.extend(map(_page_id, plan.hits))  # in C: a prompt's hits
                req.hashes.extend(map(_page_hash, plan.hits))
            req.pages.extend(taken)  # the loads' pages first, in chain order
            if plan.loads:
                req.hashes.extend(load.hit.page_hash for load in plan.loads)
                loads = [replace(ld, device_page=page) for ld, page in zip(plan.loads, taken)]
                req.loads.extend(loads)
                self.tiers.pin(loads)
                self.tiers.count_served(plan.loads, self.page_size)
            self.group.page_table.set_row(req.slot, req.pages, held)
        if sessions is not None:  # a request's first reservation starts its session
            sessions.start_requests(plans, firsts)
        if pins is not None and pins.pins:  # a hit on a whole pinned prefix renews it
            pins.refresh(
                h
                for plan in plans
                for h in (*map(_page_hash, plan.hits), *(ld.hit.page_hash for ld in plan.loads))
            )
        if self._tiered:  # what the plans took (see `Tier.note_reserved`)
            self.tiers.note_reserved(fresh, [plan.device_hit_run(self.page_size) for plan in plans])

    def _take_joint(self, joint: JointGroups, plans: list[Reservation]) -> None:
        """`_take` on a cache of groups (`JointGroups.take`): the plans' pages in every
        group, their tier hits pinned in their groups' tiers, their sessions started,
        the pins they hit renewed."""
        sessions, pins = self.sessions, self.pins
        if sessions is not None or pins is not None:
            self.end_overdue()  # before evicting
        firsts = [not plan.req.pages for plan in plans]
        for plan, first in zip(plans, firsts):
            if first and plan.req.control is None:
                self._keep_control(plan.req, plan.ctx)
            if plan.joint is not None:
                self.undo.push(setattr, self, "cache_tokens", self.cache_tokens)
                self.cache_tokens += plan.hit_tokens - len(plan.req.hashes) * self.page_size
        for g, group_loads in loads_by_group(joint.take(plans), len(self.group_tiers)):
            self.group_tiers[g].pin(group_loads)
        for plan in plans:
            hit = plan.joint
            if hit is not None and hit.num_device >= 0:
                served = (len(hit.hashes) - hit.num_device) * self.page_size
                self.tiers.count_tokens(hit.slowest_tier, served)
        if sessions is not None:  # a request's first reservation starts its session
            sessions.start_requests(plans, firsts)
        if pins is not None and pins.pins:  # a hit on a whole pinned prefix renews it
            pins.refresh(h for plan in plans if plan.joint for h in plan.joint.hashes)

    def _keep_control(self, req: RequestState, ctx: TextGenerationContext) -> None:
        """A request's first reservation keeps what its context asks of the cache (its
        write policy, its pin at release)."""
        control = getattr(ctx, "cache_control", None)
        if control is not None:
            self.undo.push(setattr, req, "control", None)
            req.control = control

    def _settle(self, moving: list[Reservation], mark: int) -> None:
        """After a context's `skip_cached_prefix` raised: a plan stands if its context
        moved (a window cannot be moved back), else it is undone, with the changes since
        `mark` (the pages it evicted come back)."""
        moved = [plan for plan in moving if plan.ctx.start_idx == plan.hit_tokens]
        if len(moved) < len(moving):
            self.undo.rollback(mark)
            if moved:
                self._take(moved)
        if moved:
            self.undo.commit()
