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

The replica holds the requests and drives parts that own their own state, each in its
module: built from the params by `replica_parts.py` (groups, budget, state, tiers,
joint hit, sessions, pins); reserving is planned once, then applied: `plan` works out
one request's hits and fresh pages without changing anything (`planner.py`), `fits`
checks a batch of plans against the pool, `apply` takes their pages in one
all-or-nothing pool call before it moves the contexts' windows (`take.py`); the pages a
step filled are planned and committed by `commit.py`; tier hits wait as pending loads
until `fetch` loads them (`loads.py`). Sessions (`params.sessions`, `sessions.py`): a
request's first reservation starts its session, its release makes the session retain
its chain. Pins (`params.pins`, `pins.py`): a reservation's hits renew the pins they
complete, a release with `ctx.cache_control.pin_ttl_s` pins the request's chain, and a
request's write policy caps what `commit` indexes.

Undo. Every change records how to undo it in `undo` (`mokv.undo.UndoLog`, the
manager's), which the pool, the tiers and the event recorder share, so that the manager
rolls back a call that raised anywhere. A context's window cannot be moved back: once
`apply` moved the windows of its hit contexts, it commits the log (the reservation
stands, and so does everything before it in the call).
"""

from __future__ import annotations

from collections.abc import Sequence

from max.driver import Buffer
from max.nn.kv_cache import RecurrentStateInputsPerDevice

from ...context import RequestID, TextGenerationContext
from ...errors import (
    AlreadyClaimedError,
    BatchTooLargeError,
    InvariantError,
    UnknownRequestError,
)
from ...events.publisher import EventRecorder, GroupSpec
from ...layouts.paged import PagedInputs
from ..base import check_request_id
from .batch_inputs import BatchInputs
from .commit import PageCommitter, plan_commit
from .loads import PendingLoads
from .pins import NO_GRANT, PinGrant
from .planner import ReservationPlanner
from .plans import HELD, CommitPlan, Held, RequestState, Reservation
from .replica_parts import ReplicaParts
from .take import ReservationTaker


class PagedReplica:
    """The pages, buffers, requests and tiers of one replica (its devices split the KV
    heads)."""

    def __init__(self, parts: ReplicaParts) -> None:
        """A replica of `parts` (`replica_parts.build_replica_parts`)."""
        self.params = parts.params
        self.undo = undo = parts.undo
        self.page_size = parts.params.page_size
        self.max_seq_len = max_seq_len = parts.max_seq_len
        self.max_requests = max_requests = parts.max_requests
        self.devices = parts.devices
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
        self._tiered = bool(self.tiers)  # read on every commit plan
        self.joint = parts.joint
        self.sessions = parts.sessions
        self.pins = parts.pins
        self.planner = ReservationPlanner(parts, self.page_size, max_seq_len)
        self.taker = ReservationTaker(parts, undo, self.page_size)
        self.committer = PageCommitter(parts, undo)
        self.loads = PendingLoads(parts, undo)
        self.inputs = BatchInputs(parts, undo)
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self._requests: dict[RequestID, RequestState] = {}

    # --- requests -------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        """Requests the replica can still claim."""
        return len(self._free_slots)

    @property
    def input_tokens(self) -> int:
        """Prompt tokens the graph inputs made the model process (`BatchInputs`)."""
        return self.inputs.input_tokens

    @property
    def cache_tokens(self) -> int:
        """Prompt tokens the reservations found cached (`ReservationTaker.cache_tokens`)."""
        return self.taker.cache_tokens

    @property
    def withheld_pages(self) -> int:
        """Pages write policies kept out of the index (`PageCommitter.withheld_pages`)."""
        return self.committer.withheld_pages

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
            self.loads.unpin(req)
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
        return self.loads.described(self._request(request_id))

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
        """Whether the pool can take every plan's hits and fresh pages at once
        (`ReservationTaker.fits`)."""
        return self.taker.fits(plans)

    def apply(self, plans: list[Reservation]) -> None:
        """Takes the pages of `plans` (which `fits`), then moves each hit context's
        window and commits the undo log (`ReservationTaker.apply`)."""
        self.taker.apply(plans)

    def end_overdue(self) -> bool:
        """Ends the sessions and pins past their time to live; whether any ended
        (`ReservationTaker.end_overdue`)."""
        return self.taker.end_overdue()

    # --- commits (`step`) -----------------------------------------------------------

    def plan_commit(self, batch: Sequence[TextGenerationContext]) -> CommitPlan:
        """`commit.plan_commit` over this replica's requests (pure)."""
        keyed = self.pool.events is not None or self._tiered  # what events and tiers read
        return plan_commit(batch, self._requests, self._request, self.chains, keyed)

    def commit(self, plan: CommitPlan) -> None:
        """Indexes the planned pages and hands the new ones to the tiers
        (`PageCommitter.commit`)."""
        self.committer.commit(plan)

    # --- tiers ----------------------------------------------------------------------

    def load_pending(self, batch: list[TextGenerationContext]) -> None:
        """Loads the tier hits of `batch`'s requests into their device pages and indexes
        them there (`PendingLoads.load`)."""
        self.loads.load([self._requests[ctx.request_id] for ctx in batch])

    def reset_metrics(self) -> None:
        self.inputs.input_tokens = self.taker.cache_tokens = self.committer.withheld_pages = 0
        for group in self.groups:
            group.pool.num_evicted_retained = 0
        for stack in self.group_tiers:
            stack.reset_metrics()
        if self.sessions is not None:
            self.sessions.reset_metrics()
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
        """InvariantError unless the pending loads and the tiers' pins agree
        (`PendingLoads.check`)."""
        self.loads.check(self._requests)

    # --- graph inputs ---------------------------------------------------------------

    def runtime_inputs(
        self, batch: list[TextGenerationContext], num_steps: int
    ) -> list[PagedInputs[Buffer, Buffer]]:
        """The batch's lookup table, cache lengths and max lengths on each device
        (`BatchInputs.runtime_inputs`). Every request must already hold its pages."""
        reqs = [self._requests[ctx.request_id] for ctx in batch]
        return self.inputs.runtime_inputs(batch, reqs, num_steps)

    def check_tables(self, batch: list[TextGenerationContext], num_steps: int) -> None:
        """InvariantError unless the tables `runtime_inputs` hands out for `batch` are safe
        (`BatchInputs.check_tables`; `enable_runtime_checks`)."""
        self.inputs.check_tables(batch, self._requests, num_steps)

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
