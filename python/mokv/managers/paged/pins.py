"""The pins of one paged replica: prefixes held with a time to live (`KVCacheParams.pins`,
`mokv.PinConfig`, `mokv.CacheControl`).

A pin holds a hash chain (a prefix of a request's committed or found pages) until its
deadline. Pins are keyed by their chain's last hash (a chained hash names its whole
prefix): pinning a prefix pinned already renews that pin (the later deadline wins).
Hashes are counted per pin, as sessions count theirs, and pinned in the device pool
and the tiers that pin (`PagePool.pin`, `TierStack.pin_prefixes`) while some pin
holds them.

    a pin is asked for              `plan_pin` + `apply`: granted for the longest
      (`manager.pin`, a release       leading part of the chain that the device or a
      with `cache_control.pin_ttl_s`,  tier that keeps pins still holds and the budget
      `manager.pin_session`)           allows (`PinGrant` says how much)
    a reservation hits the whole    `refresh`: its deadline becomes now + its ttl
      pinned prefix
    its deadline passes             ended at the replica's next reservation,
                                      release or pin (`plan_expiry`)

The budget: the distinct hashes all pins hold never exceed `cap` = `max_share *
device pages`, so at least the rest of the pages keep plain LRU order for everything
unpinned and a request that fits them can always be admitted. Without a tier that
takes pins, a pinned page without an owner is never evicted; with the host tier, a page
the host tier holds may leave the device (after every kept page), and the host tier
keeps it until the pin ends.

Every change is planned first (pure: `plan_*`, a `PinPlan`), then applied with plain
dict operations that cannot fail half-way (`apply`), recording its undo in the
manager's log (`mokv.undo`), as the session table does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ...cache.page_pool import PagePool
from ...config.cache_control import PinConfig
from ...errors import InvariantError
from ...metrics import CacheControlMetrics
from ...registry import BUILDERS
from ...tiers.stack import TierStack
from ...undo import UndoLog, set_values, values_of
from .chain_counts import check_counts
from .groups.budget import budget_part
from .window_tails import Change, TailRule, at_either_end, in_both, split_groups


class PinGrant(NamedTuple):
    """What a pin request got."""

    requested_tokens: int
    """Tokens asked for (whole pages of the request's committed or found prefix)."""
    pinned_tokens: int
    """Tokens pinned: fewer than asked when the budget ran out or the chain's later pages
    are held nowhere any more (0: none)."""
    expires_at: float
    """The pin's deadline on the replica's clock (`-inf` when nothing was pinned)."""

    @property
    def partial(self) -> bool:
        return self.pinned_tokens < self.requested_tokens


NO_GRANT = PinGrant(0, 0, -math.inf)


@dataclass(eq=False, slots=True)
class Pin:
    """One live pin."""

    chain: tuple[int, ...]
    ttl_s: float
    deadline: float


@dataclass(slots=True)
class PinPlan:
    """What one change of the pins does (`PinTable.plan_*`)."""

    now: float
    expired: list[Pin] = field(default_factory=list)
    key: int | None = None
    """The last hash of the chain pinned (None: no pin made or renewed)."""
    pin: Pin | None = None
    """The pin made or renewed, with its new deadline and ttl."""
    requested: int = 0
    """Pages asked for."""

    def __bool__(self) -> bool:
        return bool(self.expired) or self.pin is not None


class PinTable:
    """The live pins of one replica, over its pools and tiers (see the module
    docstring): `groups` are its cache groups' `(pool, tiers, pages_in_window)`, one for
    a replica of one group. A group without a window pins the whole chains, within
    `cap`; a sliding group only their tails (`WindowTails`), within its own budget
    (`group_cap`). `shared`: the pools that are views of one shared budget
    (`groups/budget.py`), each as large as the memory: each of their groups' budget is of
    a `1 / len(shared)` part of it, so that all pins together stay within `max_share`; a
    pool outside it (the checkpoints') has a budget of all its pages (`budget_part`)."""

    def __init__(
        self,
        config: PinConfig,
        groups: Sequence[tuple[PagePool, TierStack, int | TailRule]],
        undo: UndoLog | None = None,
        shared: Sequence[PagePool] = (),
    ) -> None:
        self.config = config
        self.clock = config.clock
        self.undo = undo
        self._whole, self._windows = split_groups(
            groups,
            undo,
            lambda pool, tiers: in_both(pool.pin, tiers.pin_prefixes),
            lambda pool, tiers: at_either_end(in_both(pool.unpin, tiers.unpin_prefixes)),
            "pinned_hashes",
        )
        self._pools = [pool for pool, _, _ in groups]
        # The hashes pinned whole must fit the smallest group that holds them whole.
        self._shared = shared
        self.cap = min(self.group_cap(pool) for pool, _ in self._whole or [groups[0][:2]])
        self.pins: dict[int, Pin] = {}
        self._count: dict[int, int] = {}  # pinned hash -> pins holding it
        self.reset_metrics()

    def group_cap(self, pool: PagePool) -> int:
        """The most pages pins may hold in a group of `pool`."""
        return self.config.cap(budget_part(pool, self._shared))

    def reset_metrics(self) -> None:
        self.num_granted = self.num_partial = self.num_refused = 0
        self.num_refreshed = self.num_expired = 0

    # --- queries ----------------------------------------------------------------------

    @property
    def pinned_hashes(self) -> frozenset[int]:
        return frozenset(self._count)

    def metrics(self) -> CacheControlMetrics:
        return CacheControlMetrics(
            pins=len(self.pins),
            pinned_pages=len(self._count),
            pinned_device_pages=sum(pool.num_pinned for pool in self._pools),
            granted=self.num_granted,
            partial=self.num_partial,
            refused=self.num_refused,
            refreshed=self.num_refreshed,
            expired=self.num_expired,
            spilled_pages=sum(pool.num_spilled for pool in self._pools),
        )

    # --- plans (pure) -----------------------------------------------------------------

    def plan_expiry(self) -> PinPlan:
        """The pins past their deadline end (live while `clock() < deadline`)."""
        now = self.clock()
        return PinPlan(now, [pin for pin in self.pins.values() if pin.deadline <= now])

    def plan_pin(self, chain: Sequence[int], ttl_s: float) -> PinPlan:
        """Pins the longest leading part of `chain` that is still held and the budget
        allows, for `ttl_s` seconds (the pins past their deadline end first)."""
        plan = self.plan_expiry()
        plan.requested = len(chain)
        chain = chain[: self._held(chain)]
        ending: dict[int, int] = {}
        for pin in plan.expired:
            for h in set(pin.chain):
                ending[h] = ending.get(h, 0) + 1
        count = self._count
        distinct = len(count) - sum(count[h] == n for h, n in ending.items())
        granted, seen = 0, set()
        for h in chain:
            if count.get(h, 0) - ending.get(h, 0) <= 0 and h not in seen:
                if distinct >= self.cap:
                    break
                distinct += 1
                seen.add(h)
            granted += 1
        if not granted:
            return plan
        key = chain[granted - 1]
        old = self.pins.get(key)
        deadline = plan.now + ttl_s
        if old is not None and old not in plan.expired:  # renewed: the later one wins
            plan.pin = Pin(old.chain, max(old.ttl_s, ttl_s), max(old.deadline, deadline))
        else:
            plan.pin = Pin(tuple(chain[:granted]), ttl_s, deadline)
            changes = self._changes(plan.expired, plan.pin)
            if any(
                tails.size_after(changes) > self.group_cap(pool) for tails, pool, _ in self._windows
            ):
                plan.pin = None  # a window's budget cannot take its tail: refused
                return plan
        plan.key = key
        return plan

    def _held(self, chain: Sequence[int]) -> int:
        """How many leading hashes of `chain` every group of whole chains holds, on the
        device or in a tier that keeps pins. A pin holds pages that exist: a session's
        retained chain may have lost pages to eviction (retention orders evictions, it
        does not prevent them), and a pin on a lost hash would count against the budget
        and report tokens as pinned that nothing holds."""
        held = len(chain)
        for pool, tiers in self._whole:
            held = next(
                (
                    i
                    for i, h in enumerate(chain[:held])
                    if pool.page_of(h) is None and not tiers.holds_pinnable(h)
                ),
                held,
            )
        return held

    @staticmethod
    def _changes(expired: Iterable[Pin], new: Pin | None) -> list[Change]:
        """The pinned chains before and after (`WindowTails.apply`)."""
        changes: list[Change] = [(pin.chain, (), True) for pin in expired]
        if new is not None:
            changes.append(((), new.chain, True))
        return changes

    def grant(self, plan: PinPlan, page_size: int) -> PinGrant:
        """What `plan` (from `plan_pin`) grants, in tokens."""
        if plan.pin is None:
            return PinGrant(plan.requested * page_size, 0, -math.inf)
        pages = min(plan.requested, len(plan.pin.chain))
        return PinGrant(plan.requested * page_size, pages * page_size, plan.pin.deadline)

    # --- changes ----------------------------------------------------------------------

    def apply(self, plan: PinPlan) -> None:
        """Applies `plan` to the pins, the pool and the tiers. Cannot fail half-way."""
        if plan.requested:
            self._count_grant(plan)
        if not plan:
            return
        self._snapshot()
        count, ended, new = self._count, [], []
        for pin in plan.expired:
            del self.pins[pin.chain[-1]]
            for h in set(pin.chain):
                count[h] -= 1
                if not count[h]:
                    del count[h]
                    ended.append(h)
        self.num_expired += len(plan.expired)
        added = None
        if plan.pin is not None and plan.key is not None:
            if plan.key not in self.pins:
                added = plan.pin
                for h in reversed(dict.fromkeys(plan.pin.chain)):  # tails first
                    count[h] = count.get(h, 0) + 1
                    if count[h] == 1:
                        new.append(h)
            self.pins[plan.key] = plan.pin
        # A hash an expired pin held and the new one holds again stays pinned throughout.
        gone = [h for h in ended if h not in count]
        again = set(ended)
        new = [h for h in new if h not in again]
        for pool, tiers in self._whole:
            pool.unpin(gone)
            tiers.unpin_prefixes(gone)
            pool.pin(new)
            tiers.pin_prefixes(new)
        if self._windows:
            changes = self._changes(plan.expired, added)
            for tails, _, _ in self._windows:
                tails.apply(changes)

    def _count_grant(self, plan: PinPlan) -> None:
        if self.undo is not None:
            self.undo.push(set_values, self, self._COUNTERS, values_of(self, self._COUNTERS))
        if plan.pin is None:
            self.num_refused += 1
            return
        self.num_granted += 1
        self.num_partial += len(plan.pin.chain) < plan.requested

    def refresh(self, page_hashes: Iterable[int]) -> None:
        """A reservation found these pages: each pin whose last hash is among them lives
        another `ttl_s` from now. Cannot fail half-way."""
        pins = self.pins
        hit = [pins[h] for h in page_hashes if h in pins]
        if not hit:
            return
        self._snapshot()
        now = self.clock()
        for pin in hit:
            pin.deadline = max(pin.deadline, now + pin.ttl_s)
        self.num_refreshed += len(hit)

    def clear(self) -> None:
        """`reset_prefix_cache`: every pin ends (the pool forgets its pins itself)."""
        self._snapshot()
        for _, tiers in self._whole:
            tiers.unpin_prefixes(list(self._count))
        for tails, _, tiers in self._windows:
            tiers.unpin_prefixes(tails.clear())
        self.pins.clear()
        self._count.clear()

    # --- undo (run by `UndoLog.rollback`, newest change first) ------------------------

    def _snapshot(self) -> None:
        """Records how to restore every pin and count (pins are few: a budget's worth of
        pages at most)."""
        if self.undo is not None:
            self.undo.push(
                self._restore,
                [(k, pin, pin.deadline, pin.ttl_s) for k, pin in self.pins.items()],
                dict(self._count),
                values_of(self, self._COUNTERS),
            )

    _COUNTERS = ("num_granted", "num_partial", "num_refused", "num_refreshed", "num_expired")

    def _restore(
        self,
        pins: list[tuple[int, Pin, float, float]],
        count: dict[int, int],
        counters: tuple[int, ...],
    ) -> None:
        self.pins.clear()
        for key, pin, deadline, ttl_s in pins:
            pin.deadline, pin.ttl_s = deadline, ttl_s
            self.pins[key] = pin
        self._count.clear()
        self._count.update(count)
        set_values(self, self._COUNTERS, counters)

    def check_invariants(self) -> None:
        """InvariantError unless the counts match the pins' chains, the pool pins exactly
        those hashes, and the pins stay within the budget."""
        for key, pin in self.pins.items():
            if not pin.chain or pin.chain[-1] != key:
                raise InvariantError(f"pin under {key} holds a chain ending elsewhere")
        chains = [pin.chain for pin in self.pins.values()]
        for pool, _ in self._whole:
            check_counts("pins hold", chains, self._count, pool.pinned_hashes, self.cap)
        for tails, pool, _ in self._windows:
            tails.check_invariants("pins hold", chains, self.group_cap(pool))


BUILDERS.register(PinConfig, PinTable)
