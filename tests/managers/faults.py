"""Fault injection for the all-or-nothing tests: an exception raised *instead of* an inner
call, or *right after* it returned (what a `KeyboardInterrupt`, a `MemoryError` or a
failing callback do), and the state a manager holds, read through public calls."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import mokv
from mokv import TextContext
from mokv.events.publisher import EventPublisher
from mokv.tiers.host import HostTier

MODES = ("instead", "after")


class Injected(BaseException):
    """Stands for a KeyboardInterrupt or MemoryError raised inside a call."""


class Faults:
    """Wraps each `(owner, name)` of `targets` so that, once armed, the `fault_at`-th call
    among them all raises `Injected`: instead of running (mode "instead"), or after it
    returned (mode "after"). `calls` counts the calls since arming (nested ones too)."""

    def __init__(self, monkeypatch, targets: Iterable[tuple[object, str]]) -> None:
        self.calls, self.fault_at, self.mode = 0, -1, "instead"
        for owner, name in targets:
            monkeypatch.setattr(owner, name, self._wrap(getattr(owner, name)))

    def _wrap(self, fn: Callable) -> Callable:
        def injected(*args, **kwargs):
            self.calls += 1
            call = self.calls
            if call == self.fault_at and self.mode == "instead":
                raise Injected(f"fault instead of call {call} ({fn.__qualname__})")
            result = fn(*args, **kwargs)
            if call == self.fault_at and self.mode == "after":
                raise Injected(f"fault after call {call} ({fn.__qualname__})")
            return result
        return injected

    def arm(self, fault_at: int, mode: str = "instead") -> None:
        self.calls, self.fault_at, self.mode = 0, fault_at, mode

    def disarm(self) -> None:
        self.fault_at = -1


def snapshot(m: mokv.PagedKVCacheManager, contexts: list[TextContext]) -> tuple:
    """Everything the paged manager and the contexts hold but the metrics, read through
    public calls: (replicas, requests, windows, events).

    A replica is each page's (owners, hash, tokens, cached) in every cache group, the
    group of each slot of its shared budget (with groups), its free request slots,
    each tier's state and its sessions' (`session_state`); a request is its replica,
    pages (every group's, from the first it holds), hash chain and pending loads; the events are every record each publisher
    holds or handed over. The
    order of the free list and of the LRU is not read: a rolled-back call gives pages
    back to their young ends, which changes which page is handed out next, not who
    owns what.
    """
    replicas = []
    for r in m.replicas:
        pages: tuple = tuple(
            (pool.ref_count(p), pool.page_hash(p), pool.page_tokens(p), pool.is_cached(p))
            for pool in (g.pool for g in r.groups)
            for p in range(pool.num_pages)
        )
        budget = r.budget  # with groups: which group each slot of the shared budget is
        if budget is not None:
            pages += ((tuple(budget.owner), tuple(sorted(budget.free_slots))),)
        replicas.append(
            (
                pages,
                r.num_free_slots,
                tuple(tier_state(t) for stack in r.group_tiers for t in stack),
                session_state(r),
            )
        )
    requests: list[tuple] = []
    for ctx in contexts:
        rid = ctx.request_id
        if not m.contains(rid):
            requests.append((rid, None))
            continue
        index = m.get_replica(ctx)
        owner = m.replicas[index]
        requests.append(
            (
                rid,
                index,
                tuple(sorted(owner.pages_by_group(rid).items())),
                tuple(owner.committed_hashes(rid)),
                tuple(owner.pending_loads(rid)),
            )
        )
    windows = tuple((c.start_idx, c.active_idx, c.end_idx) for c in contexts)
    events = tuple(recorded(p) for p in m.kv_event_publishers)
    return tuple(replicas), tuple(requests), windows, events


def keep_handed_over(monkeypatch) -> None:
    """From now on every batch a publisher hands to its thread is also kept."""
    end_step = EventPublisher.end_step

    def keeping(self):
        if self._pending:
            self.__dict__.setdefault("handed_over", []).extend(self._pending)
        end_step(self)

    monkeypatch.setattr(EventPublisher, "end_step", keeping)


def recorded(publisher: EventPublisher) -> tuple:
    """Every record of `publisher` since `keep_handed_over`, handed over or pending."""
    return (*publisher.__dict__.get("handed_over", ()), *publisher._pending)


def session_state(replica) -> tuple:
    """The replica's open sessions (each one's chain, running requests and deadline), the
    hashes they retain, and what its pool retains and keeps (empty without sessions);
    then its pins and what its pool and host tier pin (nothing without pins)."""
    table, pins = replica.sessions, replica.pins
    state: tuple = ()
    if table is not None:
        state = (tuple((sid, s.chain, s.running, s.deadline) for sid, s in table.sessions.items()),
                 table.retained_hashes,
                 tuple((g.pool.retained_hashes, g.pool.num_kept) for g in replica.groups))
    if pins is not None:  # and the pins: each one's chain, deadline and ttl, where pinned
        hosts = [stack.named("host") for stack in replica.group_tiers]
        state += (tuple(sorted((k, p.chain, p.deadline, p.ttl_s) for k, p in pins.pins.items())),
                  pins.pinned_hashes,
                  tuple((g.pool.pinned_hashes, g.pool.num_pinned) for g in replica.groups),
                  tuple(host.pinned_prefixes if host is not None else None for host in hosts))
    return state


def tier_state(tier) -> tuple:
    """A host tier's (each page's hash and tokens, the indexed hashes, the pins, the
    retained hashes); a shared tier's state is its server's."""
    if not isinstance(tier, HostTier):
        return ()
    pool = tier.pool
    return (tuple((pool.page_hash(p), pool.page_tokens(p)) for p in range(pool.num_pages)),
            frozenset(pool.indexed_hashes()), tuple(sorted(tier.pinned.items())),
            pool.retained_hashes)
