"""JointGroups: the cache groups of a replica driven together, when there are several or
one with a sliding window (`PagedReplica.joint`; a replica of one full group drives it
directly, on the paths tuned for it).

The joint prefix hit. Each group's pool holds its own copy of a prefix's pages, under
the same chain hashes (a page of tokens has one hash whatever group holds it), and each
loses them on its own. The hit a request can take is the longest prefix *every* group
can serve: a full group needs every page of it, a sliding-window group only the pages
its window reads before the hit's end. A sliding group's hit is a suffix run that moves
with the hit's end, so shortening the hit for one group can break another's run; the
hit is narrowed group by group until a whole pass agrees (`longest_hit`). A minimum over
the groups' own answers is wrong: a window's longest run may end past a full group's
hit, and its run below that end may have a hole. MAX 26.7 (`longest_joint_prefix_hit`)
and vLLM (`HybridKVCacheCoordinator`) iterate the same way; tests check this one
against MAX's.

What each group takes of a hit of `n` pages is its `held_of_hit(n)` last pages; the
pages of a sliding group's row below them are pad entries it never holds. Every group
takes the same fresh pages a reservation counts (`Reservation.num_fresh`: a page per
new page index), so a plan fits when every group's pool has room for them besides its
hits (`Reservation.room` is the least room).

A replica with state layers (`states`: `state.py`) adds their rule to the joint hit (a
checkpoint at the hit's end), resumes each taken request's state, and takes checkpoints
when steps end on their boundaries (`slide`); its checkpoints take no room from the
attention groups' pools.

Per request, every group has a row of page ids of the same length (`RequestState.rows`)
and a first page it holds (`RequestState.firsts`); a sliding group's first moves up as
the window does (`slide`, after each step's commits and when a hit moves the window).

Memory. With a shared budget (`budget.py`, MAX 26.7's Jenga pool), the groups' pools
are views of one allocation whose slots move to the group that needs them: `fits`,
`room` and `take` ask the budget which slots each group must (and may cheaply) take
before each pool takes its pages, so a group under pressure gets memory another group
does not use, and each pool's accounting (room, eviction order) stays exact. A sliding
group's slides keep the window before `keep_ends` (where a later joint hit ends) ahead
of the pages no joint hit can read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import cast

from max.driver import Buffer

from ....cache.extra_keys import request_keys
from ....context import RequestID, TextGenerationContext
from ....errors import InvariantError, StaleContextError
from ....layouts.max_paged import LOOKUP_PAD_PAGE
from ....layouts.paged import PagedInputs
from ....tiers.stack import PendingLoad, TierStack
from ....undo import UndoLog
from ..group_tiers import Found, TierFind, found_in_tiers
from ..plans import CommitPlan, JointHit, RequestState, Reservation
from ..prefix import PrefixChains
from .budget import SharedBudget
from .full import FullAttentionGroup
from .state import Checkpoint, RecurrentStateGroup
from .state_shared import SharedCheckpoint


class JointGroups:
    """The groups of one replica (in graph-input order), over the replica's chains;
    `tiers`: each group's tiers (`group_tiers.py`), None without tiers."""

    def __init__(
        self,
        groups: Sequence[FullAttentionGroup],
        chains: PrefixChains,
        undo: UndoLog,
        tiers: Sequence[TierStack] | None = None,
        budget: SharedBudget | None = None,
        states: RecurrentStateGroup | None = None,
    ) -> None:
        self.groups = list(groups)
        self.states = states
        self.chains = chains
        self.page_size = chains.page_size
        self.undo = undo
        self.tiers = list(tiers) if tiers else None
        self.budget = budget
        self.full = next((g for g in self.groups if not g.pages_in_window), None)
        """The first group whose layers read every token (its shared pages show where
        requests' prompts part: `keep_ends`), if any."""

    def new_request(self, slot: int) -> RequestState:
        """A claimed request's state, with an empty row in every group."""
        rows: tuple[list[int], ...] = tuple([] for _ in self.groups)
        return RequestState(slot, pages=rows[0], rows=rows, firsts=[0] * len(self.groups))

    def check_window(self, ctx: TextGenerationContext, req: RequestState) -> None:
        """StaleContextError unless every group holds the pages a step from the
        context's `start_idx` reads (a context moved back, e.g. by `ctx.reset()` without
        a release, would read pages a window released)."""
        start = ctx.start_idx
        if self.states is not None:
            self.states.check_window(ctx, req)
        for group in self.groups:
            if group.window_start(start) < group.first(req):
                raise StaleContextError(
                    f"request {ctx.request_id!r} has start_idx={start}, whose window reads "
                    f"page {group.window_start(start)} of group {group.name!r}, which its "
                    f"window released (it holds pages from {group.first(req)} on): release "
                    "the request before ctx.reset()"
                )

    # --- the joint prefix hit (pure) ------------------------------------------------

    def hit(self, ctx: TextGenerationContext, req: RequestState) -> JointHit | None:
        """The longest prefix continuing the request's committed pages that every group
        can serve, with the pages each takes; None when there is none (or no prefix may
        extend the request now: `PrefixChains.can_match`)."""
        chains, ps = self.chains, self.page_size
        if not chains.can_match(ctx, req):
            return None
        first, end = len(req.hashes), (ctx.end_idx - 1) // ps
        if end <= first:
            return None
        chain, _ = chains.pages(ctx, req, end)
        device = [cast(list[Found], self._found(group, chain)) for group in self.groups]
        found: list[Sequence[Found]] = list(device)
        if self.tiers is not None:  # a tier's page counts as found (`group_tiers.py`)
            found = [
                found_in_tiers(stack, chain, f, group.pages_in_window)
                for group, stack, f in zip(self.groups, self.tiers, device)
            ]
        rules = [
            partial(group.longest_hit, cast(list[int | None], pages))  # found: not None
            for group, pages in zip(self.groups, found)
        ]
        n = longest_joint_hit(rules, len(chain))
        checkpoints: list[Checkpoint | None] = []
        if self.states is not None and n:  # never past the attention groups' hit: look
            checkpoints = self.states.found(chain[:n])  # no further (a shared tier's probe)
            n = longest_joint_hit([*rules, partial(self.states.longest_hit, checkpoints)], n)
        if not n:
            return None
        held = [group.held_of_hit(n) for group in self.groups]
        pages = [
            self._loads(g, cast(list[int | TierFind], f[n - k : n]), n - k, chain, ctx, req)
            for g, (f, k) in enumerate(zip(found, held))
        ]  # all found
        checkpoint = checkpoints[n - 1] if checkpoints else None
        assert not isinstance(checkpoint, SharedCheckpoint), "the state's rule loaded it"
        hit = JointHit([h for h, _ in chain[:n]], pages, checkpoint)
        tiers = [p.tier for row in pages for p in row if isinstance(p, PendingLoad)]
        if tiers:  # the tokens the devices alone would not serve count as a tier's
            # (the groups' joint device hit: vLLM's and MAX's, before a connector's)
            device_rules = [
                partial(group.longest_hit, cast(list[int | None], pages))
                for group, pages in zip(self.groups, device)
            ]
            hit.num_device = longest_joint_hit(device_rules, n)
            hit.slowest_tier = max(tiers)
        return hit

    def _loads(
        self,
        g: int,
        entries: list[int | TierFind],
        start: int,
        chain: list[tuple[int, bytes]],
        ctx: TextGenerationContext,
        req: RequestState,
    ) -> list[int | PendingLoad]:
        """Group `g`'s pages of a hit (`entries`, from chain page `start` on): each tier
        page a `PendingLoad` of that group, with its parent hash and event keys."""
        if all(entry.__class__ is int for entry in entries):
            return cast(list[int | PendingLoad], entries)
        keys, ps = request_keys(ctx), self.page_size
        first = len(req.hashes)
        out: list[int | PendingLoad] = []
        for i, entry in enumerate(entries, start):
            if isinstance(entry, TierFind):
                parent = chain[i - 1][0] if i else (req.hashes[-1] if first else None)
                page_keys = keys.page(first + i, ps) if keys is not None else None
                out.append(PendingLoad(entry.tier, entry.hit, parent, page_keys, group=g))
            else:
                out.append(entry)
        return out

    @staticmethod
    def _found(group: FullAttentionGroup, chain: list[tuple[int, bytes]]) -> list[int | None]:
        """The group's page of each `(hash, token bytes)` of the chain, None where its
        pool has none (a full group's run only: it needs every page up to a hit)."""
        if group.pages_in_window:
            return [group.pool.lookup(h, data) for h, data in chain]
        run: list[int | None] = [page_id for page_id, _ in group.pool.lookup_run(chain)]
        return run + [None] * (len(chain) - len(run))

    def plan(
        self, ctx: TextGenerationContext, req: RequestState, num_steps: int, max_seq_len: int
    ) -> Reservation:
        """`PagedReplica.plan`'s reservation (the request does not hold the steps yet): the
        joint prefix hit, then the fresh pages after it, which every group takes. Pure."""
        hit = self.hit(ctx, req)
        num_hits = len(hit.hashes) if hit is not None else 0
        hit_tokens, num_new = req.reservation_size(
            ctx, num_hits, num_steps, self.page_size, max_seq_len
        )
        parent = req.hashes[-1] if req.hashes else None
        plan = Reservation(ctx, req, (), hit_tokens, num_new, [], parent, joint=hit)
        plan.room = self.room(hit)
        return plan

    def hit_pages(self, ctx: TextGenerationContext, req: RequestState) -> tuple[int, int]:
        """Pages of `ctx`'s tokens the replica could serve now (the joint hit): those
        the groups' devices alone serve, and those past them that need a tier's pages."""
        hit = self.hit(ctx, req)
        if hit is None:
            return 0, 0
        n = len(hit.hashes)
        device = n if hit.num_device < 0 else hit.num_device
        return device, n - device

    def room(self, hit: JointHit | None) -> int:
        """The most fresh pages every group could hand out at once with its pages of
        `hit` taken, besides the fresh pages its tier pages load into (a shared
        budget's, or the least of the groups' pools)."""
        n = len(self.groups)
        hits = [[]] * n if hit is None else [hit.device_pages(g) for g in range(n)]
        loads = [0] * n if hit is None else [hit.num_loads(g) for g in range(n)]
        if self.budget is not None:
            return self.budget.room(hits, loads)
        return min(group.pool.room(h) - k for group, h, k in zip(self.groups, hits, loads))

    def fits(self, plans: Sequence[Reservation]) -> bool:
        """Whether every group can take the plans' hits and fresh pages at once."""
        num_fresh = sum(plan.num_fresh for plan in plans)
        hits = [self._hit_pages(plans, g) for g in range(len(self.groups))]
        loads = [self._num_loads(plans, g) for g in range(len(self.groups))]
        if self.budget is not None:
            return self.budget.grants(num_fresh, hits, loads) is not None
        return all(
            group.pool.can_take(h, num_fresh + k) for group, h, k in zip(self.groups, hits, loads)
        )

    @staticmethod
    def _hit_pages(plans: Sequence[Reservation], g: int) -> list[int]:
        return [p for plan in plans if plan.joint is not None for p in plan.joint.device_pages(g)]

    @staticmethod
    def _num_loads(plans: Sequence[Reservation], g: int) -> int:
        return sum(plan.joint.num_loads(g) for plan in plans if plan.joint is not None)

    # --- changes --------------------------------------------------------------------

    def take(self, plans: Sequence[Reservation]) -> list[PendingLoad]:
        """Takes the plans' hits and fresh pages in every group's pool (which `fits`),
        extends each request's rows and chain, and slides each window to where the hit
        moved it. A tier page of a hit takes a fresh page, which becomes a pending load
        of its request (`RequestState.loads`); returns those loads (to pin)."""
        num_fresh = sum(plan.num_fresh for plan in plans)
        hits = [self._hit_pages(plans, g) for g in range(len(self.groups))]
        loads = [self._num_loads(plans, g) for g in range(len(self.groups))]
        if self.budget is not None:  # the slots each group needs first
            moves = self.budget.grants(num_fresh, hits, loads)
            if moves is None:
                raise InvariantError("a reservation that fits could not take its slots")
            self.budget.move(moves)
        fresh = []
        for group, group_hits, group_loads in zip(self.groups, hits, loads):
            pages = group.pool.take(group_hits, num_fresh + group_loads)
            if pages is None:
                raise InvariantError("a reservation that fits could not take its pages")
            fresh.append(pages)
        ps = self.page_size
        taken_loads: list[PendingLoad] = []
        for plan in plans:
            req, hit = plan.req, plan.joint
            held = len(req.pages)
            self.undo.push(
                self._truncate,
                req,
                held,
                len(req.hashes),
                list(req.firsts),
                len(req.loads),
                req.hit_end,
            )
            n = len(hit.hashes) if hit is not None else 0
            if hit is not None:
                req.hashes.extend(hit.hashes)
                req.hit_end = held + n
            for g, group in enumerate(self.groups):
                row, taken = req.rows[g], fresh[g]
                if hit is not None:
                    hit_pages = hit.pages[g]
                    row.extend([LOOKUP_PAD_PAGE] * (n - len(hit_pages)))  # below the window
                    for entry in hit_pages:
                        if isinstance(entry, PendingLoad):
                            entry = replace(entry, device_page=taken.pop())
                            taken_loads.append(entry)
                            req.loads.append(entry)
                            row.append(entry.page)
                        else:
                            row.append(entry)
                row.extend(taken[: plan.num_fresh])
                del taken[: plan.num_fresh]
                if hit is not None and group.pages_in_window:
                    self._skip(group, req, held, (held + n) * ps)
                group.write_row(req)
            if self.states is not None:
                self.states.resume(req, hit.checkpoint if hit is not None else None, held)
        return taken_loads

    def _skip(self, group: FullAttentionGroup, req: RequestState, held: int, hit_end: int) -> None:
        """After a hit ending at token `hit_end` on a request that held `held` pages: the
        group holds its pages from the hit's window start on, so the pages it held
        below that go back (head first) and its first moves up."""
        first, new_first = req.firsts[group.index], group.window_start(hit_end)
        if new_first > first:
            group.pool.release(group.row(req)[first : min(held, new_first)])
            req.firsts[group.index] = new_first

    def slide(self, req: RequestState, ctx: TextGenerationContext) -> None:
        """Every group releases the request's pages that no step from the context's
        `start_idx` reads, a sliding group's evicted first but for the windows before
        `keep_ends`; the state layers take a checkpoint if the step ended on their
        boundary."""
        start_idx = ctx.start_idx
        ends: tuple[int, ...] | None = None
        for group in self.groups:
            if group.pages_in_window and group.window_start(start_idx) > group.first(req):
                ends = self.keep_ends(req) if ends is None else ends
                group.slide(req, start_idx, ends)
        if self.states is not None:
            page = start_idx // self.page_size - 1
            first = self.groups[0]  # the page's tokens: the page was just committed there
            tokens = None
            if first.first(req) <= page < len(first.row(req)):
                tokens = first.pool.page_tokens(first.row(req)[page])
            self.states.slide(req, start_idx, tokens, ctx)

    def keep_ends(self, req: RequestState) -> tuple[int, int]:
        """Where a later joint hit on the request's prefix is likely to end: after the
        last joint hit it took (`hit_end`), and after the leading pages it shares with
        other requests in the full group (their prompts part there). A sliding group
        keeps the windows before these ends ahead of its other pages."""
        shared = 0
        full = self.full
        if full is not None:
            pool, row = full.pool, req.pages if full.index == 0 else full.row(req)
            while shared < len(row) and pool.ref_count(row[shared]) > 1:
                shared += 1
        return req.hit_end, shared

    def release(self, req: RequestState) -> None:
        """Hands back every page the request holds, in every group."""
        for group in self.groups:
            group.release(req)
        if self.states is not None:
            self.states.release(req)

    def commit_pages(self, plan: CommitPlan) -> list[list[bool]]:
        """Indexes the planned pages in every group (each shares its own duplicates);
        per group, True where a page was indexed."""
        return [group.commit_pages(plan) for group in self.groups]

    def reset_prefix_cache(self) -> None:
        for group in self.groups:
            group.pool.reset_prefix_cache()
        if self.states is not None:
            self.states.reset_prefix_cache()

    def _truncate(
        self,
        req: RequestState,
        num_pages: int,
        num_hashes: int,
        firsts: list[int],
        num_loads: int,
        hit_end: int,
    ) -> None:
        """Undoes what a request's rows, chain, firsts, loads and hit end gained
        (idempotent)."""
        del req.hashes[num_hashes:]
        del req.loads[num_loads:]
        req.firsts[:] = firsts
        req.hit_end = hit_end
        for group in self.groups:
            del group.row(req)[num_pages:]
            group.write_row(req)

    # --- graph inputs and checks ----------------------------------------------------

    def runtime_inputs(
        self, slots: Sequence[int], starts: Sequence[int], actives: Sequence[int], num_steps: int
    ) -> list[PagedInputs[Buffer, Buffer]]:
        """Every group's inputs for a batch, group by group, each one per device."""
        return [
            device_inputs
            for group in self.groups
            for device_inputs in group.runtime_inputs(slots, starts, actives, num_steps)
        ]

    def check_write_windows(
        self,
        batch: Sequence[TextGenerationContext],
        requests: Mapping[RequestID, RequestState],
        num_steps: int,
    ) -> None:
        """`FullAttentionGroup.check_write_windows` in every group for the batch's steps,
        and InvariantError unless each request holds every page its step reads (from its
        window's start on)."""
        windows = [
            (
                ctx.request_id,
                requests[ctx.request_id],
                ctx.start_idx,
                ctx.active_idx + num_steps - 1,
            )
            for ctx in batch
        ]
        for group in self.groups:
            for request_id, req, start, _ in windows:
                if group.first(req) > group.window_start(start):
                    raise InvariantError(
                        f"request {request_id!r} reads page {group.window_start(start)} of "
                        f"group {group.name!r}, which it released (it holds from "
                        f"{group.first(req)})"
                    )
            group.check_write_windows(
                (request_id, group.row(req), start, end) for request_id, req, start, end in windows
            )

    def check_invariants(self, requests: Iterable[RequestState]) -> None:
        """InvariantError unless every group's pool agrees with the pages the requests
        hold, every row is as long as the first, and no first is past its row."""
        requests = list(requests)
        for req in requests:
            if len(req.rows) != len(self.groups) or req.rows[0] is not req.pages:
                raise InvariantError(f"request in slot {req.slot} has no row in every group")
            for group in self.groups:
                row, first = group.row(req), group.first(req)
                if len(row) != len(req.pages) or not 0 <= first <= len(row):
                    raise InvariantError(
                        f"request in slot {req.slot}: group {group.name!r} holds pages "
                        f"[{first}, {len(row)}) of {len(req.pages)}"
                    )
        budget = self.budget
        for g, group in enumerate(self.groups):
            owners = [group.held(req) for req in requests]
            if budget is not None:  # the pages of the slots the group does not have
                owners.append(budget.held(g))
            group.check_invariants(owners)
        if budget is not None:
            budget.check_invariants()
        if self.states is not None:
            self.states.check_invariants()


def longest_joint_hit(rules: Sequence[Callable[[int], int]], n: int) -> int:
    """The longest prefix of at most `n` pages every group can serve: `rules[g](m)` is
    group `g`'s longest hit of at most `m` pages. Each group is asked under the prefix
    the groups before it allowed, pass after pass, until a whole pass changes nothing
    (a group asked again about a hit it allowed allows it again, so this ends)."""
    while True:
        m = n
        for rule in rules:
            m = rule(m)
        if m == n:
            return n
        n = m
