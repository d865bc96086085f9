"""All-or-nothing calls: a rejected call changes nothing, and an exception raised from
anywhere inside a call (injected instead of every inner call in turn, and right after it
returned) leaves the old state or the new one, with every invariant intact, no page
lost, and the call itself working when retried."""

from __future__ import annotations

import itertools

import mokv
import numpy as np
import pytest
from max.driver import CPU
from mokv import TextContext
from mokv.cache import page_copy
from mokv.cache.page_copy import HostPages
from mokv.cache.page_pool import PagePool
from mokv.events import KVEventBatch, PrefixRouterIndex, build_events
from mokv.events.publisher import _REMOVED, EventPublisher, EventRecorder, MediumSink
from mokv.managers.paged import commit, planner, prefix
from mokv.managers.paged.groups import (
    FullAttentionGroup,
    JointGroups,
    SharedBudget,
    SlidingWindowGroup,
)
from mokv.managers.paged.inputs import PageTable
from mokv.managers.paged.pins import PinTable
from mokv.managers.paged.prefix import PrefixChains
from mokv.managers.paged.replica import PagedReplica
from mokv.managers.paged.sessions import SessionTable
from mokv.tiers.host import HostTier
from mokv.tiers.host_pool import HostPagePool
from mokv.tiers.stack import TierStack

from .conftest import NUM_LAYERS, make_paged, small_params
from .faults import MODES, Faults, Injected, keep_handed_over, recorded, snapshot

NUM_PAGES = 12
_endpoints = itertools.count()


class World:
    """A paged manager and three requests: A and B share a 2-page prefix, C does not."""

    num_pages = NUM_PAGES

    def __init__(self, session):
        self.m = make_paged(session, num_pages=self.num_pages, max_seq_len=24, **self.options())
        prefix = [1, 2, 3, 4, 5, 6, 7, 8]
        self.A = TextContext(prefix + [9, 9], request_id="A")
        self.B = TextContext(prefix + [7], request_id="B")
        self.C = TextContext([3, 3, 3, 3, 3], request_id="C")
        self.contexts = [self.A, self.B, self.C]

    def options(self) -> dict:
        return {}

    def check_events(self) -> None:
        """Nothing to check without events."""

    def close(self) -> None:
        self.m.close()


class HostWorld(World):
    """The same requests on 6 device pages and a 10-page host tier; C is long enough to
    evict every cached device page."""

    num_pages = 6

    def __init__(self, session):
        super().__init__(session)
        self.C = TextContext(np.arange(100, 121), request_id="C")
        self.contexts = [self.A, self.B, self.C]

    def options(self) -> dict:
        bytes_per_page = small_params().bytes_per_page(NUM_LAYERS)
        return dict(tiers=(mokv.HostTierConfig(swap_space_gb=10 * bytes_per_page / 2**30),))


class EventsMixin(World):
    """Publishes events (a real publisher on an in-process socket); every batch handed to
    the publisher thread is kept, and with the records still pending must rebuild the
    device and host indexes exactly."""

    def options(self) -> dict:
        endpoint = f"inproc://all-or-nothing-{next(_endpoints)}"
        return dict(super().options(), kv_events=mokv.KVEventsConfig(endpoint=endpoint))

    def check_events(self) -> None:
        (publisher,) = self.m.kv_event_publishers
        records = list(recorded(publisher))
        index = PrefixRouterIndex(page_size=self.m.page_size)
        index.apply(("m", 0), KVEventBatch(0.0, build_events(records, self.m.page_size), 0))
        replica = self.m.replicas[0]
        for g, (group, stack) in enumerate(zip(replica.groups, replica.group_tiers)):
            assert index.hashes(("m", 0), "device", g) == group.pool.indexed_hashes()
            host = stack.named("host")
            assert index.hashes(("m", 0), "host", g) == (
                host.pool.indexed_hashes() if host is not None else set())


class EventsWorld(EventsMixin, World):
    pass


class HostEventsWorld(EventsMixin, HostWorld):
    pass


class GroupWorld(World):
    """The same requests on a cache of two groups: a sliding window of 5 tokens (one
    page before the one written) and a full group, 24 pages in all. A's step slides its
    window off its first page; B's hit takes the full group's two pages and the
    window's last one."""

    def __init__(self, session):
        super().__init__(session)
        self.num_pages = self.m.total_num_pages

    def options(self) -> dict:
        return dict(groups=(mokv.CacheGroupConfig("sliding", 1, window_size=5),
                            mokv.CacheGroupConfig("full", 1)))


class GroupsMixin(World):
    """A world's requests on a cache of two groups, a window of 5 tokens and a full group,
    each with its own device pages (6 in a host world) and tiers."""

    def __init__(self, session):
        super().__init__(session)
        self.num_pages = self.m.total_num_pages

    def options(self) -> dict:
        return dict(super().options(), groups=(mokv.CacheGroupConfig("sliding", 1, window_size=5),
                                               mokv.CacheGroupConfig("full", 1)))


class GroupHostEventsWorld(GroupsMixin, EventsMixin, HostWorld):
    """The host tier's requests on a cache of groups, publishing events."""


class WideGroupWorld(GroupWorld):
    """Groups of different page sizes in one budget of 10 slots (a slot: one sliding
    page, or two full ones). A (6 pages) takes 9 slots at its fetch; its step slides 4
    sliding pages off its window; C's 3 pages in the full group then take the free slot
    and one of the sliding group's cached pages (evicting it), and B, after A's release,
    takes a slot of two full pages back for the sliding group (evicting a cached one)."""

    num_pages = 5

    def __init__(self, session):
        super().__init__(session)
        self.A = TextContext(np.arange(1, 24), request_id="A")
        self.B = TextContext(np.arange(1, 14), request_id="B")
        self.C = TextContext([3] * 10, request_id="C")
        self.contexts = [self.A, self.B, self.C]

    def options(self) -> dict:
        return dict(groups=(mokv.CacheGroupConfig("sliding", 1, window_size=5),
                            mokv.CacheGroupConfig("full", 1, n_kv_heads=1)))


WIDE_SCENARIO = [
    (None, lambda w: w.m.external_claim(w.A.request_id)),
    (None, lambda w: w.m.fetch([w.A])),
    (lambda w: w.A.update(11), lambda w: _step(w, [w.A])),
    (None, lambda w: w.m.external_claim(w.C.request_id)),
    (None, lambda w: w.m.fetch([w.C])),  # a slot moves from the sliding group
    (lambda w: w.C.update(13), lambda w: _step(w, [w.C])),
    (None, lambda w: w.m.release(w.A.request_id)),
    (None, lambda w: w.m.external_claim(w.B.request_id)),
    (None, lambda w: w.m.fetch([w.B])),
    (lambda w: w.B.update(12), lambda w: _step(w, [w.B])),
    (None, lambda w: w.m.release(w.B.request_id)),
    (None, lambda w: w.m.release(w.C.request_id)),
    (None, lambda w: w.m.reset_prefix_cache()),
]


class Clock:
    """The sessions' injected clock."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


class SessionWorld(EventsMixin, HostWorld):
    """Sessions over the host tier's 6 device and 10 host pages (a share of 0.25: 4
    pages), with events: A and B are two turns of session "s"; C takes free pages, D (an
    adapter and an image, salted) evicts unretained ones; E opens session "u" and the cap
    drops "s"; F opens session "t", which then outlives its time-to-live."""

    def __init__(self, session):
        self.clock = Clock()
        World.__init__(self, session)
        prefix = [1, 2, 3, 4, 5, 6, 7, 8]
        self.A = TextContext(prefix + [9, 9], request_id="A", session_id="s")
        self.B = TextContext(prefix + [9, 9, 11, 7], request_id="B", session_id="s")
        self.C = TextContext(np.arange(100, 113), request_id="C")
        self.D = TextContext([1, 2, 3, 4, 0, 0, 0, 0, 5], request_id="D", cache_salt="t",
                             lora_name="math", lora_id=1,
                             mm_inputs=[mokv.MultimodalInput("img", 4, 4)])
        self.E = TextContext(np.arange(200, 209), request_id="E", session_id="u")
        self.F = TextContext(np.arange(300, 305), request_id="F", session_id="t")
        self.contexts = [self.A, self.B, self.C, self.D, self.E, self.F]

    def options(self) -> dict:
        return dict(super().options(),
                    sessions=mokv.SessionConfig(ttl_s=10.0, max_share=0.25, clock=self.clock))


class GroupSessionWorld(GroupsMixin, SessionWorld):
    """The sessions' requests on a cache of groups."""


class PinWorld(EventsMixin, HostWorld):
    """Pins over the host tier's 6 device and 10 host pages (a budget of 3 pages), with
    events: A pins its two pages at release (read-only B hits them, renewing the pin), C
    evicts every unpinned device page and spills the pinned ones to the host tier, then
    `pin` of B (partly: the budget), and the clock ends the pins."""

    def __init__(self, session):
        self.clock = Clock()
        super().__init__(session)
        self.A.cache_control = mokv.CacheControl(pin_ttl_s=10.0)
        self.B.cache_control = mokv.CacheControl(write="read_only")
        self.D = TextContext(np.arange(40, 53), request_id="D")
        self.E = TextContext([1, 2, 3, 4, 5, 6, 7, 8, 5], request_id="E")
        self.contexts += [self.D, self.E]

    def options(self) -> dict:
        return dict(super().options(), pins=mokv.PinConfig(max_share=0.5, clock=self.clock))


class GroupPinWorld(GroupsMixin, PinWorld):
    """The pins' requests on a cache of groups."""


class OverduePinWorld(World):
    """Pins without a tier on 6 device pages (a budget of 3): A pins its two pages at
    release; past its deadline F wants all six pages, which do not fit until the refused
    reservation ends the overdue pin and plans again (`PagedReplica.end_overdue`)."""

    num_pages = 6

    def __init__(self, session):
        self.clock = Clock()
        super().__init__(session)
        self.A.cache_control = mokv.CacheControl(pin_ttl_s=10.0)
        self.F = TextContext(np.arange(60, 81), request_id="F")  # six pages with its next
        self.contexts += [self.F]

    def options(self) -> dict:
        return dict(super().options(), pins=mokv.PinConfig(max_share=0.5, clock=self.clock))


def _expire(w: SessionWorld | PinWorld) -> None:
    w.clock.now += 11.0


def _step(w: World, batch: list[TextContext]) -> None:
    w.m.step(batch)


# (what the caller does first, without faults; the one manager call under test)
SCENARIO = [
    (None, lambda w: w.m.external_claim(w.A.request_id)),
    (None, lambda w: w.m.maybe_reserve(w.A)),
    (None, lambda w: w.m.fetch([w.A])),
    (lambda w: w.A.update(11), lambda w: _step(w, [w.A])),  # commits A's two full pages
    (None, lambda w: w.m.external_claim(w.B.request_id)),
    (None, lambda w: w.m.external_claim(w.C.request_id)),
    (None, lambda w: w.m.fetch([w.B, w.C], num_steps=2)),  # B reserves A's pages as hits
    (lambda w: (w.B.update(12), w.C.update(13)), lambda w: _step(w, [w.B, w.C])),
    (None, lambda w: w.m.fetch([w.A, w.B, w.C], num_steps=3)),
    (lambda w: [c.update(14) for c in w.contexts], lambda w: _step(w, w.contexts)),
    (None, lambda w: w.m.reset_prefix_cache()),  # refused: A, B and C hold pages
    (None, lambda w: w.m.release(w.A.request_id)),
    (None, lambda w: w.m.release(w.B.request_id)),
    (None, lambda w: w.m.release(w.C.request_id)),
    (None, lambda w: w.m.reset_prefix_cache()),
]


# The host tier's path: A's pages are written through, evicted from the device by C,
# and loaded back for B (reserved first, so that `fetch` only runs the loads).
HOST_SCENARIO = [
    (None, lambda w: w.m.external_claim(w.A.request_id)),
    (None, lambda w: w.m.fetch([w.A])),
    (lambda w: w.A.update(11), lambda w: _step(w, [w.A])),  # writes A's two pages through
    (None, lambda w: w.m.release(w.A.request_id)),
    (None, lambda w: w.m.external_claim(w.C.request_id)),
    (None, lambda w: w.m.fetch([w.C])),  # evicts A's pages from the device
    (lambda w: w.C.update(12), lambda w: _step(w, [w.C])),
    (None, lambda w: w.m.release(w.C.request_id)),
    (None, lambda w: w.m.external_claim(w.B.request_id)),
    (None, lambda w: w.m.maybe_reserve(w.B)),  # two host hits, pinned
    (None, lambda w: w.m.fetch([w.B])),  # loads them
    (lambda w: w.B.update(13), lambda w: _step(w, [w.B])),
    (None, lambda w: w.m.release(w.B.request_id)),
    (None, lambda w: w.m.reset_prefix_cache()),
]

# Sessions: a turn starts its session, a release retains its chain, a second turn finds
# it, the share cap drops a session, end_session, and the time-to-live (advanced by the
# clock, applied by the next call that plans the sessions).
SESSION_SCENARIO = [
    (None, lambda w: w.m.external_claim(w.A.request_id)),
    (None, lambda w: w.m.fetch([w.A])),  # opens session "s"
    (lambda w: w.A.update(11), lambda w: _step(w, [w.A])),
    (None, lambda w: w.m.release(w.A.request_id)),  # "s" retains A's two pages
    (None, lambda w: w.m.external_claim(w.C.request_id)),
    (None, lambda w: w.m.fetch([w.C])),
    (lambda w: w.C.update(12), lambda w: _step(w, [w.C])),
    (None, lambda w: w.m.release(w.C.request_id)),
    (None, lambda w: w.m.external_claim(w.D.request_id)),
    (None, lambda w: w.m.maybe_reserve(w.D)),  # evicts C's pages, not the session's
    (None, lambda w: w.m.fetch([w.D])),
    (lambda w: w.D.update(13), lambda w: _step(w, [w.D])),
    (None, lambda w: w.m.release(w.D.request_id)),
    (None, lambda w: w.m.external_claim(w.B.request_id)),
    (None, lambda w: w.m.maybe_reserve(w.B)),  # a turn: finds the session's pages
    (None, lambda w: w.m.fetch([w.B])),
    (lambda w: w.B.update(14), lambda w: _step(w, [w.B])),
    (None, lambda w: w.m.release(w.B.request_id)),  # "s" retains three pages
    (None, lambda w: w.m.external_claim(w.E.request_id)),
    (None, lambda w: w.m.fetch([w.E])),
    (lambda w: w.E.update(15), lambda w: _step(w, [w.E])),
    (None, lambda w: w.m.release(w.E.request_id)),  # past the cap: "s" is dropped
    (None, lambda w: w.m.external_claim(w.F.request_id)),
    (None, lambda w: w.m.fetch([w.F])),
    (lambda w: w.F.update(16), lambda w: _step(w, [w.F])),
    (None, lambda w: w.m.release(w.F.request_id)),
    (None, lambda w: w.m.end_session("u")),
    (_expire, lambda w: w.m.end_session("gone")),  # "t" outlived its time-to-live
    (None, lambda w: w.m.reset_prefix_cache()),
]

PIN_SCENARIO = [
    (None, lambda w: w.m.external_claim(w.A.request_id)),
    (None, lambda w: w.m.fetch([w.A])),
    (lambda w: w.A.update(11), lambda w: _step(w, [w.A])),
    (None, lambda w: w.m.release(w.A.request_id)),  # pins A's two pages
    (None, lambda w: w.m.external_claim(w.B.request_id)),
    (None, lambda w: w.m.fetch([w.B])),  # hits the whole pin: renewed
    (lambda w: w.B.update(12), lambda w: _step(w, [w.B])),  # read-only: commits nothing
    (None, lambda w: w.m.release(w.B.request_id)),
    (None, lambda w: w.m.external_claim(w.C.request_id)),
    (None, lambda w: w.m.fetch([w.C])),  # six pages: the pinned ones spill to the host
    (lambda w: w.C.update(13), lambda w: _step(w, [w.C])),
    (None, lambda w: w.m.release(w.C.request_id)),
    (None, lambda w: w.m.external_claim(w.D.request_id)),
    (None, lambda w: w.m.fetch([w.D])),
    (lambda w: w.D.update(14), lambda w: _step(w, [w.D])),
    (None, lambda w: w.m.pin(w.D.request_id, 5.0)),  # three pages, one left in the budget
    (None, lambda w: w.m.release(w.D.request_id)),
    (_expire, lambda w: w.m.external_claim(w.E.request_id)),
    (None, lambda w: w.m.maybe_reserve(w.E)),  # ends both pins
    (None, lambda w: w.m.release(w.E.request_id)),
    (None, lambda w: w.m.reset_prefix_cache()),
]

OVERDUE_PIN_SCENARIO = [
    (None, lambda w: w.m.external_claim(w.A.request_id)),
    (None, lambda w: w.m.fetch([w.A])),
    (lambda w: w.A.update(11), lambda w: _step(w, [w.A])),
    (None, lambda w: w.m.release(w.A.request_id)),  # pins A's two pages: 4 pages of room
    (_expire, lambda w: w.m.external_claim(w.F.request_id)),
    (None, lambda w: w.m.maybe_reserve(w.F)),  # refused, ends the pin, plans again: fits
    (None, lambda w: w.m.release(w.F.request_id)),
]

SCENARIOS = {
    "device": (World, SCENARIO),
    "host": (HostWorld, HOST_SCENARIO),
    "events": (EventsWorld, SCENARIO),
    "host-events": (HostEventsWorld, HOST_SCENARIO),
    "sessions": (SessionWorld, SESSION_SCENARIO),
    "groups": (GroupWorld, SCENARIO),
    "group-tiers": (GroupHostEventsWorld, HOST_SCENARIO),
    "group-sessions": (GroupSessionWorld, SESSION_SCENARIO),
    "group-pins": (GroupPinWorld, PIN_SCENARIO),
    "wide-groups": (WideGroupWorld, WIDE_SCENARIO),
    "pins": (PinWorld, PIN_SCENARIO),
    "overdue-pin": (OverduePinWorld, OVERDUE_PIN_SCENARIO),
}


def _fault_targets():
    """Every public call below the manager's, the event sinks', the sessions' and the
    extra keys' functions."""
    return [
        (PagePool, "room"), (PagePool, "can_take"), (PagePool, "take"), (PagePool, "release"),
        (PagePool, "commit_pages"), (PagePool, "lookup"), (PagePool, "reset_prefix_cache"),
        (PagedReplica, "plan"), (PagedReplica, "fits"), (PagedReplica, "apply"),
        (PagedReplica, "commit"), (PagedReplica, "plan_commit"), (PagedReplica, "claim"),
        (PagedReplica, "release"), (PagedReplica, "runtime_inputs"),
        (PagedReplica, "check_tables"), (PagedReplica, "load_pending"),
        (PagedReplica, "check_loads"), (PagedReplica, "reset_prefix_cache"),
        (PageTable, "set_row"), (PrefixChains, "device_hits"), (prefix, "iter_page_hashes"),
        (TextContext, "skip_cached_prefix"), (TextContext, "active_idx_after_skip"),
        (TierStack, "load"), (TierStack, "store"), (TierStack, "note_reserved"),
        (TierStack, "reset"), (TierStack, "pin"), (TierStack, "unpin"),
        (TierStack, "count_served"), (HostTier, "lookup"), (HostTier, "load"),
        (HostTier, "store"), (HostTier, "note_reserved"), (HostTier, "reset"),
        (HostTier, "check_invariants"), (HostTier, "pin"), (HostTier, "unpin"),
        (HostPagePool, "lookup"), (HostPagePool, "plan_store"), (HostPagePool, "evict"),
        (HostPagePool, "insert"), (HostPagePool, "touch"), (HostPagePool, "touch_hashes"),
        (HostPagePool, "mark_loaded"), (HostPagePool, "reset_prefix_cache"),
        (HostPages, "offload"), (HostPages, "load"), (page_copy, "copy_pages"),
        (EventRecorder, "stored"), (EventRecorder, "removed"), (EventRecorder, "cleared"),
        (MediumSink, "stored"), (MediumSink, "removed"), (EventPublisher, "end_step"),
        (PagePool, "retain"), (PagePool, "unretain"), (HostPagePool, "retain"),
        (HostPagePool, "unretain"), (prefix, "hash_inputs"), (prefix, "page_keys"),
        (commit, "request_keys"), (planner, "request_keys"), (SessionTable, "plan_release"),
        (SessionTable, "plan_end"), (SessionTable, "plan_expiry"), (SessionTable, "apply"),
        (PagedReplica, "slide"), (JointGroups, "hit"), (JointGroups, "fits"),
        (JointGroups, "take"), (JointGroups, "commit_pages"), (JointGroups, "release"),
        (JointGroups, "runtime_inputs"), (JointGroups, "check_window"),
        (SlidingWindowGroup, "slide"), (FullAttentionGroup, "write_row"), (PageTable, "pad"),
        (SessionTable, "start_requests"), (SessionTable, "clear"), (PinTable, "plan_pin"),
        (PinTable, "plan_expiry"), (PinTable, "apply"), (PinTable, "refresh"),
        (PinTable, "clear"), (PagePool, "pin"), (PagePool, "unpin"),
        (PagePool, "note_spillable"), (TierStack, "pin_prefixes"),
        (TierStack, "unpin_prefixes"), (HostTier, "pin_prefixes"),
        (HostTier, "unpin_prefixes"), (PagePool, "claim"), (PagePool, "release_cold"),
        (SharedBudget, "grants"), (SharedBudget, "room"), (SharedBudget, "move"),
        (PagedReplica, "end_overdue"),
    ]


def _run(w: World, ops: list) -> None:
    for before, call in ops:
        if before:
            before(w)
        call(w)


def _release_all_and_check(w: World) -> None:
    w.m.check_invariants()
    w.check_events()
    for ctx in w.contexts:
        if w.m.contains(ctx.request_id):
            w.m.release(ctx.request_id)
    w.m.check_invariants()
    assert w.m.num_free_blocks == w.num_pages  # no page lost
    for r in w.m.replicas:
        host = r.tiers.named("host")
        assert host is None or not host.pinned


@pytest.fixture(autouse=True)
def _keep_handed_over_batches(monkeypatch):
    keep_handed_over(monkeypatch)


@pytest.mark.parametrize("world", SCENARIOS)
def test_scenario_runs_clean(session, world):
    make_world, scenario = SCENARIOS[world]
    w = make_world(session)
    _run(w, scenario)
    _release_all_and_check(w)
    w.close()


def test_host_scenario_runs_clean_and_hits_the_host(session):
    w = HostWorld(session)
    _run(w, HOST_SCENARIO)
    assert w.m.metrics.cache_tokens == w.m.metrics.host_cache_tokens == 8
    assert w.m.metrics.bytes_from_host == 2 * small_params().bytes_per_page(NUM_LAYERS)
    _release_all_and_check(w)


def test_group_tier_scenario_loads_each_groups_pages_from_its_host_tier(session):
    """B's hit of A's two pages: the full group loads both, the window (5 tokens: one
    page before the one written) only the second."""
    w = GroupHostEventsWorld(session)
    _run(w, HOST_SCENARIO)
    page_bytes = small_params().bytes_per_page(1)
    assert w.m.metrics.cache_tokens == w.m.metrics.host_cache_tokens == 8
    assert w.m.metrics.bytes_from_host == (2 + 1) * page_bytes
    _release_all_and_check(w)


def test_session_scenario_runs_clean_and_keeps_the_session(session):
    w = SessionWorld(session)
    table = w.m.replicas[0].sessions
    _run(w, SESSION_SCENARIO[:4])
    assert len(table.retained("s")) == 2 and w.m.replicas[0].pool.num_kept == 2
    _run(w, SESSION_SCENARIO[4:15])
    assert w.B.start_idx == 8  # D evicted C's pages and left the session's
    _run(w, SESSION_SCENARIO[15:22])
    s = w.m.metrics.sessions
    assert (s.turns, s.turn_hits, s.turn_cache_tokens, s.dropped) == (1, 1, 8, 1)
    assert table.retained("s") == () and len(table.retained("u")) == 2 and table.cap == 4
    _run(w, SESSION_SCENARIO[22:28])
    assert set(table.sessions) == set() and w.m.metrics.sessions.expired == 2  # "s", "t"
    assert w.m.metrics.sessions.ended == 1 and not w.m.replicas[0].pool.retained_hashes
    _run(w, SESSION_SCENARIO[28:])
    _release_all_and_check(w)
    w.close()


def test_group_scenario_slides_and_hits(session):
    w = GroupWorld(session)
    _run(w, SCENARIO[:4])
    assert w.m.get_req_blocks_per_group("A")["sliding"][0] == 1  # page 0 left the window
    _run(w, SCENARIO[4:7])
    assert w.B.start_idx == 8
    (first, pages), (_, full) = w.m.get_req_blocks_per_group("B").values()
    assert first == 1 and pages[0] == w.m.get_req_blocks_per_group("A")["sliding"][1][0]
    assert full[:2] == w.m.get_req_blocks_per_group("A")["full"][1][:2]
    _run(w, SCENARIO[7:])
    _release_all_and_check(w)


def _lost_host_entries_only(state, old) -> bool:
    """`old`, but for host pages that lost their entry (evicted to make room for a store
    whose copy overwrote them: they cannot be restored), and their removal announced."""
    if state[1:3] != old[1:3]:
        return False
    lost = set()
    for (pages, slots, tiers, sessions), (old_pages, old_slots, old_tiers, old_sessions) in zip(
            state[0], old[0]):
        if (pages, slots, sessions) != (old_pages, old_slots, old_sessions):
            return False
        for tier, old_tier in zip(tiers, old_tiers):  # each group's host tier
            (host_pages, hashes, pins, retained) = tier
            (old_host_pages, old_hashes, old_pins, old_retained) = old_tier
            if (pins, retained) != (old_pins, old_retained) or not hashes <= old_hashes:
                return False
            if any(p not in (o, (None, None)) for p, o in zip(host_pages, old_host_pages)):
                return False
            lost |= old_hashes - hashes
    removed = {(_REMOVED, page_hash, "CPU") for page_hash in lost}
    return bool(lost) and all(
        records[:len(old_records)] == old_records
        and {record[:3] for record in records[len(old_records):]} <= removed
        for records, old_records in zip(state[3], old[3]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world,op", [(name, op) for name, (_, sc) in SCENARIOS.items()
                                      for op in range(len(sc))])
def test_an_exception_anywhere_leaves_old_or_new_state(session, monkeypatch, world, op, mode):
    """Each fault leaves the old state (then the call, retried, gives the new one) or
    the new one; then the rest of the scenario runs, every request is released, and
    every page is back."""
    make_world, scenario = SCENARIOS[world]
    clean = make_world(session)
    _run(clean, scenario[: op + 1])
    new_state = snapshot(clean.m, clean.contexts)
    clean.close()
    faults = Faults(monkeypatch, _fault_targets())
    num_faults = 0
    for fault_at in range(1, 300):
        w = make_world(session)
        faults.disarm()
        _run(w, scenario[:op])
        before, call = scenario[op]
        if before:
            before(w)
        old_state = snapshot(w.m, w.contexts)
        faults.arm(fault_at, mode)
        try:
            call(w)
        except Injected:
            num_faults += 1
            faults.disarm()
            state = snapshot(w.m, w.contexts)
            where = f"op {op}, fault {mode} inner call {fault_at}"
            if state != new_state:
                assert state == old_state or _lost_host_entries_only(state, old_state), where
                w.m.check_invariants()
                call(w)  # the retry succeeds
                if state == old_state:
                    assert snapshot(w.m, w.contexts) == new_state, where
            _run(w, scenario[op + 1:])
            _release_all_and_check(w)
        else:
            num_calls = faults.calls
            faults.disarm()
            assert snapshot(w.m, w.contexts) == new_state
            w.close()
            break
        w.close()
    assert num_faults == num_calls  # every inner call of the op was interrupted once


def test_rejected_calls_change_nothing(session):
    m = make_paged(session, num_pages=NUM_PAGES, max_seq_len=24)
    d, a, e = TextContext(np.arange(9), "D"), TextContext(np.arange(20), "A"), TextContext([5], "E")
    for ctx in (d, a):
        m.external_claim(ctx.request_id)
    m.fetch([d])
    d.update(1)
    state = snapshot(m, [d, a, e])
    with pytest.raises(mokv.UnknownRequestError):
        m.step([d, e])  # D's full pages are not committed before E is found unknown
    with pytest.raises(mokv.SequenceTooLongError, match="'A'.*past max_seq_len=24"):
        m.fetch([d, a], num_steps=6)  # D reserves nothing before A is found too long
    with pytest.raises(ValueError, match="twice"):
        m.fetch([d, d])
    with pytest.raises(ValueError, match="twice"):
        m.step([d, d])
    with pytest.raises(mokv.InvalidReplicaError, match="replica_idx=0.0"):
        m.external_claim(e.request_id, 0.0)
    with pytest.raises(mokv.InvalidReplicaError, match="replica_idx=True"):
        m.external_claim(e.request_id, True)
    with pytest.raises(TypeError, match="request_id must be a str"):
        m.external_claim(7)
    with pytest.raises(mokv.AlreadyClaimedError):
        m.external_claim(d.request_id)
    with pytest.raises(TypeError, match="session_id must be a non-empty str, got None"):
        m.end_session(None)
    assert snapshot(m, [d, a, e]) == state
    m.check_invariants()


def test_shared_pages_are_never_handed_out_for_rewriting(session):
    m = make_paged(session, num_pages=NUM_PAGES, max_seq_len=24)
    a, e = TextContext(np.arange(9), "A"), TextContext(np.arange(9), "E")
    m.external_claim(a.request_id)
    m.fetch([a])
    a.update(3)
    m.step([a])  # A's two full pages are committed
    m.external_claim(e.request_id)
    assert m.maybe_reserve(e) and e.start_idx == 8  # E shares them
    a.reset()  # without releasing A: its window would start inside the shared pages
    state = snapshot(m, [a, e])
    with pytest.raises(mokv.StaleContextError, match=r"'A'\) has start_idx=0, inside its 8 committed"):
        m.fetch([a])
    with pytest.raises(mokv.StaleContextError):
        m.maybe_reserve(a)
    with pytest.raises(mokv.StaleContextError):
        m.step([a])
    assert snapshot(m, [a, e]) == state
    m.release(a.request_id)  # the documented way: release, then the reset context re-claims
    m.external_claim(a.request_id)
    assert m.maybe_reserve(a) and a.start_idx == 8  # and finds its prefix again


def test_runtime_checks_verify_the_tables_fetch_hands_out(session):
    m = make_paged(session, num_pages=NUM_PAGES, max_seq_len=24, checks=True)
    a = TextContext(np.arange(6), "A")
    m.external_claim(a.request_id)
    m.fetch([a])
    page = m.get_req_blocks(a.request_id)[1]
    m.replicas[0].pool.commit(page, 123, b"x")  # a bug commits a page of A's write window
    with pytest.raises(mokv.InvariantError, match="would write page"):
        m.fetch([a])


def test_continuous_and_null_check_their_arguments(session):
    cont = mokv.ContinuousBatchingKVCacheManager(
        small_params(cache_strategy="continuous"), 3, 16, NUM_LAYERS, [CPU()], session
    )
    for n in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match="positive number of sequences"):
            cont.claim(n)
    (s,) = cont.claim(1)
    with pytest.raises(ValueError, match="-5"):
        cont.step({s: -5})
    assert cont.fetch([s])[0].cache_lengths.to_numpy().tolist() == [0]
    with pytest.raises(mokv.UnknownRequestError):
        cont.step({s: 1, 2: 1})  # unknown id: the known one does not advance
    assert cont.fetch([s])[0].cache_lengths.to_numpy().tolist() == [0]
    null = mokv.NullKVCacheManager(small_params(), 2, 16, NUM_LAYERS, [CPU()], session, 0)
    ctx = TextContext([1, 2])
    with pytest.raises(mokv.SequenceTooLongError):  # seed 001: no claim needed, but room
        null.maybe_reserve(ctx, num_steps=16)
    assert not null.contains(ctx.request_id)  # the refused reservation recorded nothing
    with pytest.raises(ValueError, match="num_steps"):
        null.fetch([], num_steps=0)
    null.external_claim(ctx.request_id)
    with pytest.raises(ValueError, match="twice"):
        null.fetch([ctx, ctx])


def test_construction_checks_name_the_argument(session):
    params = small_params()
    with pytest.raises(TypeError, match="session must be a max.engine.InferenceSession"):
        mokv.PagedKVCacheManager(params, 2, 16, NUM_LAYERS, [CPU()], None, 10**6)
    with pytest.raises(TypeError, match="available_cache_memory.*1000000.0"):
        mokv.PagedKVCacheManager(params, 2, 16, NUM_LAYERS, [CPU()], session, 1e6)
    from max.dtype import DType
    with pytest.raises(ValueError, match="int8 is not a supported cache dtype"):
        small_params(dtype=DType.int8)


def test_increment_cache_lengths_checks_row_offsets(session):
    m = make_paged(session)
    a, b = TextContext(np.arange(3), "A"), TextContext(np.arange(2), "B")
    for ctx in (a, b):
        m.external_claim(ctx.request_id)
    inputs = m.fetch([a, b], num_steps=2)
    with pytest.raises(ValueError, match="non-decreasing"):
        m.increment_cache_lengths(inputs, np.array([0, 3, 2], dtype=np.uint32))
    with pytest.raises(TypeError, match="integers"):
        m.increment_cache_lengths(inputs, np.array([0, 3.0, 5.0]))
    with pytest.raises(ValueError, match="4 entries for a batch of 2"):
        m.increment_cache_lengths(inputs, np.array([0, 3, 5, 6], dtype=np.uint32))


def test_text_context_rejects_what_it_would_mangle():
    for tokens, error, match in [
        ([1.5, 2.0], TypeError, "integer token ids"),
        (np.zeros((2, 2), dtype=np.int64), ValueError, "one-dimensional"),
        ([3, -1], ValueError, r"\[-1\]"),
        ([2**63], ValueError, "2\\*\\*63"),
        ([], ValueError, "at least one"),
    ]:
        with pytest.raises(error, match=match):
            TextContext(tokens)
    ctx = TextContext([1])
    with pytest.raises(ValueError, match="new_token"):
        ctx.update(-3)


def test_pin_scenario_runs_clean_and_keeps_the_pin(session):
    w = PinWorld(session)
    pins, pool = w.m.replicas[0].pins, w.m.replicas[0].pool
    _run(w, PIN_SCENARIO[:6])
    assert w.B.start_idx == 8 and next(iter(pins.pins.values())).deadline == 10.0
    _run(w, PIN_SCENARIO[6:12])
    assert pool.num_pinned == 0 and len(pins.pinned_hashes) == 2  # spilled, still pinned
    assert w.m.metrics.cache_control.spilled_pages == 2
    _run(w, PIN_SCENARIO[12:16])
    assert len(pins.pinned_hashes) == 3 and len(pins.pins) == 2  # D got one page of three
    _run(w, PIN_SCENARIO[16:19])
    assert w.E.start_idx == 8 and not pins.pins  # found in the host tier after the pins
    c = w.m.metrics.cache_control
    assert (c.granted, c.partial, c.refreshed, c.expired, c.withheld_pages) == (2, 1, 1, 2, 0)
    _run(w, PIN_SCENARIO[19:])
    _release_all_and_check(w)
    w.close()


def test_overdue_pin_scenario_fits_only_once_the_pin_ends(session):
    w = OverduePinWorld(session)
    _run(w, OVERDUE_PIN_SCENARIO[:5])
    assert w.m.replicas[0].pool.num_pinned == 2 and w.m.metrics.free_pages == 4
    assert w.m.maybe_reserve(w.F) and not w.m.replicas[0].pins.pins
    assert w.m.metrics.cache_control.expired == 1 and len(w.m.get_req_blocks("F")) == 6
    _run(w, OVERDUE_PIN_SCENARIO[6:])
    _release_all_and_check(w)
    w.close()
