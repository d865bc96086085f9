"""The sessions of one paged replica: the hash chains they retain, and until when
(`KVCacheParams.sessions`, `mokv.SessionConfig`).

A session's life, as the replica drives it:

    a request naming it is reserved      `start`: the session opens (or a turn resumes
      for the first time                   it), and never expires while it has requests
    that request is released             `plan_release` + `apply`: the session retains the
                                           request's hash chain (the pages it committed or
                                           found), its deadline becomes now + `ttl_s`
    `manager.end_session(id)`            `plan_end` + `apply`: its retention ends
    its deadline passes, no request      ended at the replica's next reservation or
      running                              release (`plan_expiry`), or a metrics read

A session retains one chain: a release replaces it with the released request's chain,
unless that chain is a prefix of it (a request preempted early, a chunk) and would lose
pages the session still has. Retention is counted per hash (sessions sharing a system
prompt retain it once) and applied to the device pool and every tier
(`PagePool.retain`, `Tier.retain`): a retained page without an owner is evicted only
after every unretained one. In a cache of groups, every full group's pool and tiers
retain the chains, a sliding group's only their tails, the window a next turn reads
(`window_tails.py`).

The share cap: the distinct hashes all sessions retain never exceed `cap` =
`max_share * (device pages + local tier pages)`. A release that would pass it drops the
retention of the least recently used other sessions (they stay open, retaining nothing
until their next release); a chain longer than `cap` is retained up to its first `cap`
pages (a prefix is what a next turn reuses). An ended or expired session's pages become
the first evicted; a dropped session's fall back to plain LRU, at the young end as if
just released (at the old end, a cap too small for the sessions would evict each one
right after the next release: worse than no sessions at all, as measured).

Every change is planned first (pure: `plan_*`, a `RetentionPlan`), then applied with
plain dict and set operations that cannot fail half-way (`apply`), so the replica can
place the one call that may fail (the pool's) before it. `start` and `apply` record how
to undo them in the manager's undo log (`mokv.undo`), as the pools do.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ...cache.page_pool import PagePool
from ...config.sessions import SessionConfig
from ...errors import InvariantError
from ...metrics import SessionMetrics
from ...registry import BUILDERS
from ...tiers.stack import TierStack
from ...undo import UndoLog, set_values, values_of
from .chain_counts import check_counts
from .groups.budget import budget_part
from .plans import RequestState, Reservation, Session
from .window_tails import Change, TailRule, in_both, split_groups


@dataclass(slots=True)
class RetentionPlan:
    """What one change of the sessions does (`SessionTable.plan_*`)."""

    now: float
    released: Session | None = None
    """The session whose request is released (None for an end or an expiry)."""
    chain: tuple[int, ...] = ()
    """What `released` retains afterwards."""
    ended: list[Session] = field(default_factory=list)
    """Sessions that end (`end_session`)."""
    expired: list[Session] = field(default_factory=list)
    """Sessions past their deadline, ending."""
    dropped: list[Session] = field(default_factory=list)
    """Open sessions whose retention the share cap drops."""
    retain: list[int] = field(default_factory=list)
    """Hashes no session retained before (the first is evicted first among them)."""
    unretain: list[int] = field(default_factory=list)
    """Hashes no session retains after, of ended, expired or released sessions: their
    pages are the first evicted."""
    fall_back: list[int] = field(default_factory=list)
    """Hashes no session retains after, of sessions the cap drops only: plain LRU pages,
    as if just released."""

    def __bool__(self) -> bool:
        return bool(self.released or self.ended or self.expired)


class SessionTable:
    """The open sessions of one replica, over its pools and tiers (see the module
    docstring): `groups` are its cache groups' `(pool, tiers, pages_in_window)`, one
    for a replica of one group. A group without a window retains the sessions' whole
    chains; a sliding group only their tails (`WindowTails`). `shared`: the pools that
    are views of one shared budget (`groups/budget.py`), each as large as the memory: the
    share is of a `1 / len(shared)` part of it (`budget_part`)."""

    def __init__(
        self,
        config: SessionConfig,
        groups: Sequence[tuple[PagePool, TierStack, int | TailRule]],
        undo: UndoLog | None = None,
        shared: Sequence[PagePool] = (),
    ) -> None:
        self.config = config
        self.undo = undo
        self.clock = config.clock
        self._whole, self._windows = split_groups(
            groups,
            undo,
            lambda pool, tiers: in_both(pool.retain, tiers.retain),
            lambda pool, tiers: in_both(pool.unretain, tiers.unretain),
            "retained_hashes",
        )
        self._pools = [pool for pool, _, _ in groups]
        self._tier_stacks = [tiers for _, tiers, _ in groups]
        # The hashes retained whole must fit the smallest group that holds them whole.
        self.cap = config.cap(
            min(
                budget_part(pool, shared) + tiers.local_pages
                for pool, tiers in self._whole or [groups[0][:2]]
            )
        )
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._count: dict[int, int] = {}  # retained hash -> sessions retaining it
        self.reset_metrics()

    def reset_metrics(self) -> None:
        self.turns = self.turn_hits = self.turn_prompt_tokens = self.turn_cache_tokens = 0
        self.num_ended = self.num_expired = self.num_dropped = 0

    # --- queries ----------------------------------------------------------------------

    def retained(self, session_id: str) -> tuple[int, ...]:
        """The chain the open session `session_id` retains (empty if none or not open)."""
        session = self.sessions.get(session_id)
        return session.chain if session is not None else ()

    @property
    def retained_hashes(self) -> frozenset[int]:
        """Every hash some open session retains."""
        return frozenset(self._count)

    def metrics(self) -> SessionMetrics:
        """The replica's session counters (`KVCacheMetrics.sessions`); the device and host
        pools count the retained pages they evicted."""
        return SessionMetrics(
            sessions=len(self.sessions),
            retained_pages=len(self._count),
            kept_pages=sum(pool.num_kept for pool in self._pools),
            kept_host_pages=sum(tiers.kept_pages for tiers in self._tier_stacks),
            evicted_pages=sum(pool.num_evicted_retained for pool in self._pools)
            + sum(tiers.evicted_retained_pages for tiers in self._tier_stacks),
            turns=self.turns,
            turn_hits=self.turn_hits,
            turn_prompt_tokens=self.turn_prompt_tokens,
            turn_cache_tokens=self.turn_cache_tokens,
            ended=self.num_ended,
            expired=self.num_expired,
            dropped=self.num_dropped,
        )

    # --- requests ---------------------------------------------------------------------

    def start(self, session_id: str, hit_tokens: int, prompt_tokens: int) -> Session:
        """A request of `session_id` was reserved for the first time, finding `hit_tokens`
        of its `prompt_tokens` cached: opens the session, or counts a turn of an open one.
        Cannot fail half-way."""
        session = old = self.sessions.get(session_id)
        # A turn moves its session to the young end: only then is the old order needed.
        order = list(self.sessions) if old is not None else []
        counters = values_of(self, self._COUNTERS)
        if session is None:
            session = self.sessions[session_id] = Session(session_id)
        else:
            self.sessions.move_to_end(session_id)
            self.turns += 1
            self.turn_hits += hit_tokens > 0
            self.turn_prompt_tokens += prompt_tokens
            self.turn_cache_tokens += hit_tokens
        session.running += 1
        if self.undo is not None:
            self.undo.push(self._unstart, session_id, old, order, counters)
        return session

    def start_requests(self, plans: Sequence[Reservation], first: Sequence[bool]) -> None:
        """Each applied reservation that was its request's first (`first`) and names a
        session (`ctx.session_id`) starts that session (`start`). Cannot fail half-way."""
        for plan, is_first in zip(plans, first):
            if is_first and plan.req.session is None:
                session_id = getattr(plan.ctx, "session_id", None)
                if session_id is not None:
                    plan.req.session = self.start(session_id, plan.hit_tokens, plan.ctx.end_idx)
                    if self.undo is not None:
                        self.undo.push(setattr, plan.req, "session", None)

    # --- plans (pure) -----------------------------------------------------------------

    def plan_release(self, session: Session, chain: Sequence[int]) -> RetentionPlan:
        """A request of `session` holding `chain` is released (the sessions past their
        deadline end too). A session ended meanwhile retains nothing."""
        plan = self._expiry(self.clock())
        if self.sessions.get(session.session_id) is not session:
            return plan
        new = tuple(chain[: self.cap])
        if session.chain[: len(new)] == new:  # a prefix of what it holds: keep all of it
            new = session.chain
        plan.released, plan.chain = session, new
        return self._planned(plan)

    def plan_end(self, session_id: str) -> RetentionPlan:
        """`end_session(session_id)` (the sessions past their deadline end too)."""
        plan = self._expiry(self.clock())
        session = self.sessions.get(session_id)
        if session is not None and session not in plan.expired:
            plan.ended.append(session)
        return self._planned(plan)

    def plan_expiry(self) -> RetentionPlan:
        """The sessions past their deadline end."""
        return self._planned(self._expiry(self.clock()))

    def _expiry(self, now: float) -> RetentionPlan:
        plan = RetentionPlan(now)
        for session in self.sessions.values():  # by last release, for those not running
            if session.running:
                continue
            if session.deadline > now:
                break
            plan.expired.append(session)
        return plan

    def _planned(self, plan: RetentionPlan) -> RetentionPlan:
        """Fills in the hashes `plan` retains and unretains, and the sessions the share
        cap drops."""
        delta: dict[int, int] = {}

        def add(chain: Iterable[int], step: int) -> None:
            for h in chain:
                delta[h] = delta.get(h, 0) + step

        for session in (*plan.ended, *plan.expired):
            add(set(session.chain), -1)
        if plan.released is not None:
            old, new = set(plan.released.chain), set(plan.chain)
            add(new - old, 1)
            add(old - new, -1)
        count = self._count
        distinct = len(count) + sum(
            (count.get(h, 0) + d > 0) - (h in count) for h, d in delta.items()
        )
        leaving = {id(s) for s in (*plan.ended, *plan.expired)} | {id(plan.released)}
        for session in self.sessions.values():  # least recently used first
            if distinct <= self.cap:
                break
            if id(session) in leaving or not session.chain:
                continue
            plan.dropped.append(session)
            for h in set(session.chain):
                d = delta[h] = delta.get(h, 0) - 1
                distinct -= count.get(h, 0) + d == 0
        gone: set[int] = set()
        released = [plan.released] if plan.released is not None else []
        for session in (*plan.ended, *plan.expired, *released, *plan.dropped):
            out = plan.fall_back if session in plan.dropped else plan.unretain
            for h in reversed(session.chain):  # tails first
                if h not in gone and h in count and count[h] + delta.get(h, 0) == 0:
                    gone.add(h)
                    out.append(h)
        plan.retain = [h for h in reversed(plan.chain) if h not in count and delta.get(h, 0) > 0]
        return plan

    # --- changes ----------------------------------------------------------------------

    def apply(self, plan: RetentionPlan) -> int:
        """Applies `plan` (from `plan_*`) to the sessions, the pool and the tiers; returns
        the hashes no session retains any more. Cannot fail half-way."""
        if not plan:
            return 0
        count = self._count
        if self.undo is not None:  # restores old values: pushed first, idempotent
            touched = {*plan.chain}
            changed = [*plan.ended, *plan.expired, *plan.dropped]
            if plan.released is not None:
                changed.append(plan.released)
            for session in changed:
                touched.update(session.chain)
            self.undo.push(
                self._unapply,
                list(self.sessions.items()),
                [(x, x.chain, x.running, x.deadline) for x in changed],
                [(h, count.get(h)) for h in touched],
                values_of(self, self._COUNTERS),
            )
        if self._windows:  # each session's chain before and after (`WindowTails`)
            changes: list[Change] = [(s.chain, (), True) for s in (*plan.ended, *plan.expired)]
            changes += [(s.chain, (), False) for s in plan.dropped]
            if plan.released is not None:
                changes.append((plan.released.chain, plan.chain, True))
        for session in (*plan.ended, *plan.expired, *plan.dropped):
            for h in set(session.chain):
                count[h] -= 1
        released = plan.released
        if released is not None:
            old, new = set(released.chain), set(plan.chain)
            for h in new - old:
                count[h] = count.get(h, 0) + 1
            for h in old - new:
                count[h] -= 1
            released.chain = plan.chain
            released.running -= 1
            released.deadline = plan.now + self.config.ttl_s
            self.sessions.move_to_end(released.session_id)
        for h in (*plan.unretain, *plan.fall_back):
            del count[h]
        for session in plan.dropped:
            session.chain = ()
        for session in (*plan.ended, *plan.expired):
            del self.sessions[session.session_id]
        self.num_ended += len(plan.ended)
        self.num_expired += len(plan.expired)
        self.num_dropped += len(plan.dropped)
        for pool, tiers in self._whole:
            for target in (pool, tiers):
                target.retain(plan.retain)
                target.unretain(plan.unretain, old_end=True)
                target.unretain(plan.fall_back, old_end=False)
        for tails, _, _ in self._windows:
            tails.apply(changes)
        return len(plan.unretain) + len(plan.fall_back)

    def clear(self) -> None:
        """`reset_prefix_cache`: every session ends (the pools forget their retention)."""
        if self.undo is not None:
            self.undo.push(
                self._unapply,
                list(self.sessions.items()),
                [],
                list(self._count.items()),
                values_of(self, self._COUNTERS),
            )
        self.num_ended += len(self.sessions)
        self.sessions.clear()
        self._count.clear()
        for tails, _, _ in self._windows:
            tails.clear()

    # --- undo (run by `UndoLog.rollback`, newest change first) ------------------------

    _COUNTERS = (
        "turns",
        "turn_hits",
        "turn_prompt_tokens",
        "turn_cache_tokens",
        "num_ended",
        "num_expired",
        "num_dropped",
    )

    def _unstart(
        self, session_id: str, session: Session | None, order: list[str], counters: tuple
    ) -> None:
        if session is None:
            self.sessions.pop(session_id, None)
        elif self.sessions.get(session_id) is session:
            session.running -= 1
            sessions = dict(self.sessions)
            self.sessions.clear()
            self.sessions.update((k, sessions[k]) for k in order)
        set_values(self, self._COUNTERS, counters)

    def _unapply(
        self,
        sessions: list[tuple[str, Session]],
        fields: list[tuple[Session, tuple[int, ...], int, float]],
        counts: list[tuple[int, int | None]],
        counters: tuple,
    ) -> None:
        self.sessions.clear()
        self.sessions.update(sessions)
        for session, chain, running, deadline in fields:
            session.chain, session.running, session.deadline = chain, running, deadline
        for h, n in counts:
            if n is None:
                self._count.pop(h, None)
            else:
                self._count[h] = n
        set_values(self, self._COUNTERS, counters)

    def check_invariants(self, requests: Iterable[RequestState]) -> None:
        """InvariantError unless the counts match the sessions' chains, the pool retains
        exactly those hashes, the retention stays within the cap, and each session counts
        the replica's `requests` that belong to it."""
        running: dict[int, int] = {}
        for req in requests:
            if req.session is not None:
                running[id(req.session)] = running.get(id(req.session), 0) + 1
        for session in self.sessions.values():
            if session.running != running.get(id(session), 0):
                raise InvariantError(
                    f"session {session.session_id!r} counts {session.running} running "
                    f"requests, the replica holds {running.get(id(session), 0)}"
                )
        chains = [session.chain for session in self.sessions.values()]
        for pool, _ in self._whole:
            check_counts("sessions retain", chains, self._count, pool.retained_hashes, self.cap)
        for tails, _, _ in self._windows:
            tails.check_invariants("sessions retain", chains, self.cap)


BUILDERS.register(SessionConfig, SessionTable)
