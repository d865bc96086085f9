"""One data-parallel replica of the paged cache: its cache groups, its requests and its
tiers.

The replica holds the requests (their slots, hash chains, pending loads, sessions) and
drives its cache groups (`groups/`: each a set of layers with its own page pool,
buffers and page table). A cache of one full-attention group (`self.group`, whose
`pool` and `blocks` the replica names too) runs on the paths below, tuned for it; a
cache of several groups or a sliding window runs its hits, takes, commits, slides and
graph inputs through `self.joint` (`groups/joint.py`: the joint prefix hit), each group
with its own tiers (`group_tiers`, `group_tiers.py`); sessions and pins hold a sliding
group's tails of their chains (`window_tails.py`).

A request's pages, drawn as token regions (page_size 4 here):

    pages:   [ p7      ][ p2      ][ p9      ][ p4      ]
    tokens:  |committed (hashed)  |  written | reserved for this fetch   |
             0               n_hashed*ps  start_idx              needed tokens

- the first `len(hashes)` pages are full and were committed to the prefix index
  (or found in it); their hash chain is `hashes`. They may be shared with other
  requests, so the request never writes them again: its context's `start_idx` must
  lie in `[len(hashes) * page_size, len(pages) * page_size]` (else `StaleContextError`,
  e.g. after `ctx.reset()` without a release);
- pages after them hold tokens written but not yet filling a page, and room for
  the tokens of the coming `num_steps` steps.

Prefix matching (prefix.py) extends a request with the longest run of pages that
continues its hash chain: device pages first, then each tier in order.

Committing the pages a step filled (`step`) is planned by `commit.plan_commit` and
applied by `commit` through the group.
Sessions (`params.sessions`) are `sessions.py`: a request's first reservation starts
its session, its release makes the session retain its chain. Pins (`params.pins`) are
`pins.py`: a reservation's hits renew the pins they complete, a release with
`ctx.cache_control.pin_ttl_s` pins the request's chain, and a request's write policy
caps what `commit` indexes (`commit.py`).

Reserving is planned once, then applied. `plan` works out one request's hits and fresh
pages without changing anything, asking the pool once how many fresh pages it could
take (`Reservation.room`); `fits` checks a batch of plans against the pool; `apply`
takes their pages in one all-or-nothing pool call before it moves the contexts' windows.

Undo. Every change records how to undo it in `undo` (`mokv.undo.UndoLog`, the
manager's), which the pool, the tiers and the event recorder share, so that the manager
rolls back a call that raised anywhere. A context's window cannot be moved back: once
`apply` moved the windows of its hit contexts, it commits the log (the reservation
stands, and so does everything before it in the call).

Tiers (`params.tiers`, `mokv.tiers`). A tier hit takes a fresh device page and becomes
a pending load on its request, pinned in its tier from `apply` on; `fetch` runs the
pending loads of its batch (`load_pending`) before the graph
runs and then indexes the loaded pages, so later requests find them on the device.
`commit` hands the pages it newly indexed to every tier (`store`). Releasing a request
drops its pending loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from operator import attrgetter, itemgetter

from max.driver import Buffer, Device
from max.nn.kv_cache import RecurrentStateInputsPerDevice

from ...cache.hashing import PageHashFn
from ...config.params import KVCacheParams
from ...context import RequestID, TextGenerationContext
from ...errors import (
    AlreadyClaimedError,
    BatchTooLargeError,
    InvariantError,
    UnknownRequestError,
)
from ...events.publisher import EventRecorder, GroupSpec
from ...layouts.paged import PagedInputs
from ...metrics import prompt_tokens_in
from ...tiers.base import CommittedPages
from ...tiers.stack import PendingLoad
from ...undo import UndoLog
from ..base import check_request_id
from .commit import plan_commit
from .groups import JointGroups
from .pins import NO_GRANT, PinGrant
from .planner import ReservationPlanner
from .plans import HELD, CommitPlan, Held, RequestState, Reservation
from .replica_parts import build_replica_parts
from .sizing import SlotGeometry

_page_id, _page_hash = itemgetter(0), itemgetter(1)  # of a `(page id, hash)` hit
_num_fresh = attrgetter("num_fresh")  # of a `Reservation`


class PagedReplica:
    """The pages, buffers, requests and tiers of one replica (its devices split the KV
    heads)."""

    def __init__(
        self,
        params: KVCacheParams,
        num_pages: Sequence[int],
        max_requests: int,
        max_seq_len: int,
        num_layers: int,
        devices: list[Device],
        hash_fn: PageHashFn,
        root_hash: int,
        undo: UndoLog,
        slots: SlotGeometry | None = None,
    ) -> None:
        self.params = params
        self.undo = undo
        self.page_size = params.page_size
        self.max_seq_len = max_seq_len
        self.max_requests = max_requests
        self.devices = devices
        parts = build_replica_parts(
            params,
            num_pages,
            max_requests,
            max_seq_len,
            num_layers,
            devices,
            hash_fn,
            root_hash,
            undo,
            slots,
        )
        self.groups = parts.groups
        # The first group's, named for the paths of a cache of one group.
        self.group = self.groups[0]
        self.pool = self.group.pool
        self.blocks = self.group.blocks
        self.budget = parts.budget
        self.states = parts.states
        self.chains = parts.chains
        self.group_tiers = parts.group_tiers
        self.tiers = self.group_tiers[0]
        self._tiered = bool(self.tiers)  # read on every reservation
        self.joint = parts.joint
        self.sessions = parts.sessions
        self.pins = parts.pins
        self.planner = ReservationPlanner(
            self.page_size,
            max_seq_len,
            self.pool,
            self.chains,
            self.tiers,
            self.joint,
            self.pins is not None,
        )
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self._requests: dict[RequestID, RequestState] = {}
        self.input_tokens = 0
        self.cache_tokens = 0
        self.withheld_pages = 0

    # --- requests -------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        """Requests the replica can still claim."""
        return len(self._free_slots)

    @property
    def num_requests(self) -> int:
        """Requests the replica holds."""
        return len(self._requests)

    def claim(self, request_id: RequestID) -> None:
        if request_id in self._requests:
            raise AlreadyClaimedError(request_id)
        if not self._free_slots:
            raise BatchTooLargeError(
                f"cannot claim {request_id!r}: all {self.max_requests} request slots of the "
                "replica are taken (max_batch_size / data_parallel_degree)"
            )
        slot = self._free_slots.pop()
        joint = self.joint
        self._requests[request_id] = (
            RequestState(slot) if joint is None else joint.new_request(slot)
        )
        self.undo.push(self._unclaim, request_id)

    def release(self, request_id: RequestID) -> None:
        """Frees the request's pages; its session (if any) retains its chain, and its
        `cache_control.pin_ttl_s` pins it."""
        req, sessions = self._request(request_id), self.sessions
        session = req.session
        if session is not None and sessions is not None:
            retention = sessions.plan_release(session, req.hashes)
        control = req.control
        if control is not None and control.pin_ttl_s is not None:
            self.pin(req.hashes, control.pin_ttl_s, control.pin_tokens)
        if self.joint is not None:
            self.joint.release(req)
        elif req.pages:  # none: a request released after its admission did not fit
            self.pool.release(reversed(req.pages))  # tail first: the prefix is evicted last
        if req.loads:
            for g, loads in self._loads_by_group(req.loads):
                self.group_tiers[g].unpin(loads)
        del self._requests[request_id]
        self._free_slots.append(req.slot)
        self.undo.push(self._unrelease, request_id, req)
        if session is not None and sessions is not None:
            sessions.apply(retention)

    def pin(self, chain: Sequence[int], ttl_s: float, num_tokens: int | None) -> PinGrant:
        """Pins the first `num_tokens` tokens (whole pages; None: all) of `chain` for
        `ttl_s` seconds, as far as the budget allows. Cannot fail half-way."""
        pins = self.pins
        if pins is None:
            return NO_GRANT
        if num_tokens is not None:
            chain = chain[: num_tokens // self.page_size]
        plan = pins.plan_pin(chain, ttl_s)
        pins.apply(plan)
        return pins.grant(plan, self.page_size)

    def pin_request(self, request_id: RequestID, ttl_s: float, num_tokens: int | None) -> PinGrant:
        """`pin` of the request's committed (or found) pages."""
        return self.pin(self._request(request_id).hashes, ttl_s, num_tokens)

    def _unclaim(self, request_id: RequestID) -> None:
        self._free_slots.append(self._requests.pop(request_id).slot)

    def _unrelease(self, request_id: RequestID, req: RequestState) -> None:
        self._free_slots.pop()  # req.slot, appended last
        self._requests[request_id] = req

    def pages_of(self, request_id: RequestID) -> list[int]:
        """The request's pages in the first group, in token order."""
        return list(self.group.held(self._request(request_id)))

    def pages_by_group(self, request_id: RequestID) -> dict[str, tuple[int, list[int]]]:
        """Per group (by name): the first page index the request holds there, and the
        pages it holds from there on, in token order."""
        req = self._request(request_id)
        return {g.name: (g.first(req), list(g.held(req))) for g in self.groups}

    @property
    def num_free_pages(self) -> int:
        """Pages of every group that can be handed out now (cached ones included); with
        a shared budget, slots' worth of them (free slots and every group's free pages,
        by bytes)."""
        budget = self.budget
        if budget is None:
            return sum(g.pool.num_free for g in self.groups)
        return budget.num_free

    @property
    def holds_pages(self) -> bool:
        """Whether some request holds a page (of any group). Not `num_free_pages <
        num_pages`: a live pin's page that no tier can take is not room, yet no request
        holds it."""
        return any(g.held(req) for req in self._requests.values() for g in self.groups)

    @property
    def num_pages(self) -> int:
        """Pages of every group; with a shared budget, its slots."""
        budget = self.budget
        return sum(g.pool.num_pages for g in self.groups) if budget is None else budget.num_slots

    def committed_hashes(self, request_id: RequestID) -> list[int]:
        """The hash chain of the request's committed (or found) pages, in token order."""
        return list(self._request(request_id).hashes)

    def state_inputs(self, request_ids: Sequence[RequestID]) -> list[RecurrentStateInputsPerDevice]:
        """The state layers' graph inputs for these requests (`RecurrentStateGroup`)."""
        if self.states is None:
            raise InvariantError("state inputs asked of a replica without state layers")
        return self.states.runtime_inputs([self._request(r).slot for r in request_ids])

    def pending_loads(self, request_id: RequestID) -> list[tuple[str, int, int]]:
        """(tier name, device page, page hash) of each tier hit reserved for the request
        and not yet loaded, in chain order."""
        return [
            (self.group_tiers[ld.group].tiers[ld.tier].name, ld.page, ld.hit.page_hash)
            for ld in self._request(request_id).loads
        ]

    def _request(self, request_id: RequestID) -> RequestState:
        """The claimed request; TypeError for an id that is not a str, as the manager's
        `_replica_index` (`check_request_id`), else UnknownRequestError."""
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            check_request_id(request_id)
            raise UnknownRequestError(request_id) from None

    # --- prefix cache ---------------------------------------------------------------

    def prefix_hit_pages(self, ctx: TextGenerationContext) -> tuple[int, int]:
        """Pages of `ctx`'s tokens this replica could serve from its device pages, and
        from its own tiers after them (a shared tier serves every replica alike, and is
        not asked; with several groups it is, by the joint hit of every group's tiers:
        `JointGroups.hit_pages`)."""
        if self.joint is not None:
            probe = self._requests.get(ctx.request_id) or self.joint.new_request(-1)
            return self.joint.hit_pages(ctx, probe)
        req = self._requests.get(ctx.request_id) or RequestState(-1)
        hits, tail = self.chains.device_hits(ctx, req, want_tail=bool(self.tiers))
        return len(hits), (self.tiers.local_hits(tail) if tail is not None else 0)

    # --- reservation ----------------------------------------------------------------

    def plan(self, ctx: TextGenerationContext, num_steps: int) -> Reservation | Held:
        """What reserving `ctx` for `num_steps` steps takes, as a value: `HELD` when the
        request holds those steps already (most decode steps: answered here, first),
        else the `Reservation` its `planner` works out (`ReservationPlanner.plan`), which
        `fits` when the pool could take it alone now (`apply` takes it). Raises for a
        request that is unknown, stale or too long. Pure, but for what the chain memo
        remembers of its readings and the tiers' lookup counters."""
        try:  # `_request` and `check_window`'s test, inlined: this runs on every step
            req = self._requests[ctx.request_id]
        except KeyError:
            req = self._request(ctx.request_id)  # raises
        ps, start = self.page_size, ctx.start_idx
        held = len(req.pages) * ps
        if start < len(req.hashes) * ps or start > held:
            req.check_window(ctx, ps)
        if self.joint is not None:
            self.joint.check_window(ctx, req)
        # `active_idx > start_idx` holds between steps; past `max_seq_len`, a plan raises.
        needed = ctx.active_idx + num_steps - 1
        if needed <= held and needed <= self.max_seq_len:
            return HELD  # then no prefix can match either (`PrefixChains.can_match`)
        return self.planner.plan(ctx, req, num_steps, needed)

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
            self.undo.push(self._truncate, req, held, len(req.hashes), len(req.loads))
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
        for g, group_loads in self._loads_by_group(joint.take(plans)):
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

    # --- commits (`step`) -----------------------------------------------------------

    def plan_commit(self, batch: Sequence[TextGenerationContext]) -> CommitPlan:
        """`commit.plan_commit` over this replica's requests (pure)."""
        keyed = self.pool.events is not None or self._tiered  # what events and tiers read
        return plan_commit(batch, self._requests, self._request, self.chains, keyed)

    def commit(self, plan: CommitPlan) -> None:
        """Indexes the planned pages in one all-or-nothing pool call, moves each request
        off the pages that duplicate an indexed one (`FullAttentionGroup.commit_pages`),
        then hands the newly indexed pages to every tier (`Tier.store`: after the device commit, so
        a tier's failure can only leave that tier with fewer pages)."""
        indexed: list[list[bool]] = []
        if plan.withheld:
            self._withhold(plan.withheld)
        if plan.page_ids:
            if self.joint is not None:
                indexed = self.joint.commit_pages(plan)
            else:
                indexed = [self.group.commit_pages(plan)]
        for req, new_hashes in plan.requests:
            self.undo.push(self._truncate, req, len(req.pages), len(req.hashes), len(req.loads))
            req.hashes.extend(new_hashes)
        if not self._tiered:
            return
        # Every tier hears every step (a host tier's `min_hits` stores at any step).
        indexed = indexed or [[] for _ in self.group_tiers]
        for stack, group, group_indexed in zip(self.group_tiers, self.groups, indexed):
            new = [i for i, ok in enumerate(group_indexed) if ok]
            page_ids = plan.page_ids if group is self.group else None
            stack.store(
                CommittedPages(
                    [
                        page_ids[i]
                        if page_ids is not None
                        else group.row(plan.owners[i][0])[plan.owners[i][1]]
                        for i in new
                    ],
                    [plan.hashes[i] for i in new],
                    [plan.datas[i] for i in new],
                    [plan.parents[i] for i in new],
                    [plan.keys[i] for i in new],
                )
            )

    def _withhold(self, withheld: list[tuple[RequestState, int]]) -> None:
        """Counts the pages write policies newly kept out of the index."""
        self.undo.push(setattr, self, "withheld_pages", self.withheld_pages)
        for req, num_pages in withheld:
            self.undo.push(setattr, req, "num_withheld", req.num_withheld)
            self.withheld_pages += num_pages - req.num_withheld
            req.num_withheld = num_pages

    # --- tiers ----------------------------------------------------------------------

    def load_pending(self, batch: list[TextGenerationContext]) -> None:
        """Copies the tier hits of `batch`'s requests into their device pages (one batch
        per tier and device), then indexes those pages on the device and unpins the
        hits. All or nothing: the copies only write pages the requests own, so a failure
        before the index changes leaves the loads pending, to run again."""
        reqs = [self._requests[ctx.request_id] for ctx in batch]
        pending = [load for req in reqs for load in req.loads]
        if not pending:
            return
        # Every group's copies first, then the index changes: a failing copy leaves
        # every load pending.
        by_group = [
            (g, self.group_tiers[g].load(loads)) for g, loads in self._loads_by_group(pending)
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

    def _loads_by_group(self, loads: Sequence[PendingLoad]) -> list[tuple[int, list[PendingLoad]]]:
        """`loads` by cache group, in group order (one group without groups)."""
        if len(self.group_tiers) == 1:
            return [(0, list(loads))] if loads else []
        by_group: list[list[PendingLoad]] = [[] for _ in self.group_tiers]
        for load in loads:
            by_group[load.group].append(load)
        return [(g, group_loads) for g, group_loads in enumerate(by_group) if group_loads]

    def reset_metrics(self) -> None:
        self.input_tokens = self.cache_tokens = 0
        for group in self.groups:
            group.pool.num_evicted_retained = 0
        for stack in self.group_tiers:
            stack.reset_metrics()
        if self.sessions is not None:
            self.sessions.reset_metrics()
        self.withheld_pages = 0
        for group in self.groups:
            group.pool.num_spilled = 0
        if self.pins is not None:
            self.pins.reset_metrics()

    def publish_to(self, events: EventRecorder) -> None:
        """Reports the pool's and the tiers' changes to `events` (the replica's stream)."""
        events.undo = self.undo
        if self.joint is None:
            self.pool.events = events
            self.tiers.publish_to(events)
            return
        for group, stack in zip(self.groups, self.group_tiers):
            sink = events.group_sink(GroupSpec.of(group.index, group.kind, group.window_size))
            group.pool.events = sink
            stack.publish_to(sink)
        if self.states is not None:  # its checkpoints, as a group after the others
            self.states.pool.events = events.group_sink(
                GroupSpec.of(len(self.groups), self.states.kind, None)
            )

    def slide(self, batch: Sequence[TextGenerationContext]) -> None:
        """After a step's commits: every sliding-window group releases the pages of the
        batch's requests that no later step reads (`SlidingWindowGroup.slide`). Nothing
        without a window."""
        if self.joint is not None:
            for ctx in batch:
                self.joint.slide(self._requests[ctx.request_id], ctx)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix in the pool and the tiers (pending loads still
        complete)."""
        if self.joint is not None:
            self.joint.reset_prefix_cache()
        else:
            self.pool.reset_prefix_cache()
        for stack in self.group_tiers:
            stack.reset()
        if self.sessions is not None:
            self.sessions.clear()
        if self.pins is not None:
            self.pins.clear()

    def close(self) -> None:
        """Closes the tiers (they send what they queued, a bounded wait)."""
        for stack in self.group_tiers:
            stack.close()
        if self.states is not None:
            self.states.close()

    def check_loads(self) -> None:
        """InvariantError unless every pending load writes a page its request owns
        without a hash, and each tier holds exactly the pending loads' hits pinned, each
        still holding its tokens (`Tier.check_invariants`)."""
        for request_id, req in self._requests.items():
            for load in req.loads:
                page, group = load.page, self.groups[load.group]
                if page not in group.held(req) or group.pool.page_hash(page) is not None:
                    raise InvariantError(
                        f"request {request_id!r} loads into device page {page} of group "
                        f"{group.name!r}, which it does not own or which is hashed"
                    )
        pending = [ld for req in self._requests.values() for ld in req.loads]
        by_group = dict(self._loads_by_group(pending))
        for g, stack in enumerate(self.group_tiers):
            stack.check_invariants(by_group.get(g, []))

    # --- graph inputs ---------------------------------------------------------------

    def runtime_inputs(
        self, batch: list[TextGenerationContext], num_steps: int
    ) -> list[PagedInputs[Buffer, Buffer]]:
        """The batch's lookup table, cache lengths and max lengths on each device
        (`PageTable.inputs`). Every request must already hold its pages."""
        reqs = [self._requests[ctx.request_id] for ctx in batch]
        slots = [req.slot for req in reqs]
        starts = [ctx.start_idx for ctx in batch]
        actives = [ctx.active_idx - start for ctx, start in zip(batch, starts)]
        if self.joint is not None:
            inputs = self.joint.runtime_inputs(slots, starts, actives, num_steps)
        else:
            inputs = self.group.runtime_inputs(slots, starts, actives, num_steps)
        self.undo.push(setattr, self, "input_tokens", self.input_tokens)
        for req, ctx, start, active in zip(reqs, batch, starts, actives):
            if req.prompt_end < 0:
                self.undo.push(setattr, req, "prompt_end", -1)
                req.prompt_end = ctx.end_idx
            self.input_tokens += prompt_tokens_in(start, start + active, req.prompt_end)
        return inputs

    def check_tables(self, batch: list[TextGenerationContext], num_steps: int) -> None:
        """InvariantError unless the tables `runtime_inputs` hands out for `batch` are safe
        (`FullAttentionGroup.check_write_windows`; `enable_runtime_checks`)."""
        if self.joint is not None:
            self.joint.check_write_windows(batch, self._requests, num_steps)
            return
        self.group.check_write_windows(
            (
                (
                    ctx.request_id,
                    self._requests[ctx.request_id].pages,
                    ctx.start_idx,
                    ctx.active_idx + num_steps - 1,
                )
                for ctx in batch
            ),
        )

    def _truncate(self, req: RequestState, num_pages: int, num_hashes: int, num_loads: int) -> None:
        """Undoes what a request's pages, hashes and loads gained (idempotent)."""
        del req.pages[num_pages:]
        del req.hashes[num_hashes:]
        del req.loads[num_loads:]
        self.group.write_row(req)

    def check_invariants(self) -> None:
        if self.joint is not None:
            self.joint.check_invariants(self._requests.values())
        else:
            self.pool.check_invariants(req.pages for req in self._requests.values())
        for request_id, req in self._requests.items():
            if len(req.hashes) > len(req.pages):
                raise InvariantError(f"request {request_id!r} has more hashes than pages")
        if self.sessions is not None:
            self.sessions.check_invariants(self._requests.values())
        if self.pins is not None:
            self.pins.check_invariants()
        self.check_loads()
