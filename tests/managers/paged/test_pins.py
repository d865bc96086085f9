"""Pins and write policies (`KVCacheParams.pins`, `mokv.CacheControl`): a pinned prefix
survives any pressure while its pin lives (or moves to the host tier), a hit renews it,
the budget grants part of a pin and says how much, expiry is exact to the clock; a
request's write policy caps what it commits, on the device and in the tiers."""

import math

import mokv
import numpy as np
import pytest
from mokv import CacheControl, PinConfig, SessionConfig, TextContext

from ...remote.conftest import redis_server  # noqa: F401 (a fixture)
from ...tiers.test_remote import flush, fresh_namespace, remote_manager, serve
from ..conftest import NUM_LAYERS, make_paged, small_params
from .test_sessions import Clock, found, hashes, sessions, storm, turn


def pinned(ttl_s, **fields) -> CacheControl:
    return CacheControl(pin_ttl_s=ttl_s, **fields)


def test_a_pinned_prefix_survives_pressure_that_evicts_a_session(session):
    """The issue's case: a 6-page agent context under 12-of-16-page pressure."""
    agent = np.arange(25)  # six full pages
    nxt = np.r_[agent, [1, 50]]
    retained = make_paged(session, num_pages=16, max_seq_len=64, sessions=SessionConfig())
    turn(retained, agent, "agent")
    storm(retained, 100, 12)
    kept_by_retention = found(retained, nxt, "agent")
    clock = Clock()
    m = make_paged(session, num_pages=16, max_seq_len=64, pins=PinConfig(clock=clock))
    turn(m, agent, cache_control=pinned(3600))
    assert m.replicas[0].pool.num_pinned == 6
    assert m.metrics.free_pages == 10  # pinned pages are not room
    for i in range(6):  # requests of 10 pages: everything but the pin, over and over
        turn(m, np.arange(39) + 100 + 1000 * i)
        m.check_invariants()
    big = TextContext(np.arange(43) + 5000)  # 11 pages: more than the unpinned 10
    m.external_claim(big.request_id)
    assert not m.maybe_reserve(big) and m.replicas[0].pool.num_pinned == 6  # refused, kept
    m.release(big.request_id)
    clock.now = 3599.0
    assert found(m, nxt) == 24 > kept_by_retention
    c = m.metrics.cache_control
    assert (c.pins, c.pinned_pages, c.granted, c.partial, c.refreshed) == (1, 6, 1, 0, 1)
    clock.now = 3599.0 + 3600  # the renewed pin's deadline: overdue, not ended yet
    assert m.replicas[0].pool.num_pinned == 6
    big = TextContext(np.arange(43) + 6000)  # its pages are room: the 11 pages fit
    m.external_claim(big.request_id)
    assert m.maybe_reserve(big) and m.replicas[0].pool.num_pinned == 0
    assert m.metrics.cache_control.expired == 1
    m.release(big.request_id)


def test_a_hit_renews_the_pin_and_expiry_is_exact_to_the_clock(session):
    clock = Clock()
    m = make_paged(session, num_pages=8, max_seq_len=32, pins=PinConfig(clock=clock))
    table = m.replicas[0].pins
    turn(m, np.arange(9), cache_control=pinned(300))  # pins 2 pages until t=300
    (pin,) = table.pins.values()
    assert pin.deadline == 300.0 and pin.chain == hashes(np.arange(8))
    clock.now = 299.5
    assert found(m, np.arange(10)) == 8  # the whole pinned prefix: renewed to 599.5
    assert pin.deadline == 599.5
    clock.now = 400.0
    assert found(m, np.arange(5)) == 4  # a part of it does not renew it
    assert pin.deadline == 599.5
    clock.now = 599.4999
    turn(m, np.arange(100, 101))  # a reservation with no hit: the pin lives on
    assert table.pins and m.replicas[0].pool.num_pinned == 2
    clock.now = 599.5
    turn(m, np.arange(100, 101))  # at the deadline exactly: ended
    assert not table.pins and m.replicas[0].pool.num_pinned == 0
    assert m.metrics.cache_control.expired == 1
    assert m.metrics.free_pages == 8
    storm(m, 200, 3)
    assert found(m, np.arange(10)) == 0  # plain LRU again
    m.check_invariants()


def test_the_budget_grants_part_of_a_pin_and_says_how_much(session):
    clock = Clock()
    m = make_paged(session, num_pages=16, max_seq_len=32, pins=PinConfig(0.25, clock=clock))
    a = TextContext(np.arange(13))  # 3 full pages
    m.external_claim(a.request_id)
    m.fetch([a])
    a.update(1)
    m.step([a])
    grant = m.pin(a.request_id, 60)
    assert grant == mokv.PinGrant(12, 12, 60.0) and not grant.partial
    b = TextContext(np.r_[np.arange(8), np.arange(500, 509)])  # shares 2 pages with a
    m.external_claim(b.request_id)
    m.fetch([b])
    b.update(1)
    m.step([b])
    grant = m.pin(b.request_id, 120)  # 4 pages, 2 pinned already, budget 4: one more
    assert grant == mokv.PinGrant(16, 12, 120.0) and grant.partial
    assert m.replicas[0].pins.pinned_hashes == set(
        hashes(np.r_[np.arange(8), np.arange(500, 504)])
    ) | set(hashes(np.arange(12)))
    c = TextContext(np.arange(300, 305))
    m.external_claim(c.request_id)
    m.fetch([c])
    c.update(1)
    m.step([c])
    assert m.pin(c.request_id, 10) == mokv.PinGrant(4, 0, -math.inf)  # no budget left
    assert m.pin(a.request_id, 500, num_tokens=8) == mokv.PinGrant(8, 8, 500.0)
    control = m.metrics.cache_control
    assert (control.granted, control.partial, control.refused, control.pins) == (3, 1, 1, 3)
    assert m.pin(a.request_id, 30, num_tokens=12).expires_at == 60.0  # the later deadline
    for ctx in (a, b, c):
        m.release(ctx.request_id)
    m.check_invariants()


def test_pins_spill_to_the_host_tier_and_come_back(session):
    page_bytes = small_params().bytes_per_page(NUM_LAYERS)
    host = mokv.HostTierConfig(swap_space_gb=8 * page_bytes / 2**30)
    agent, nxt = np.arange(9), np.r_[np.arange(9), [1, 7]]
    for pins, expected in ((PinConfig(), 8), (None, 0)):
        m = make_paged(session, num_pages=6, max_seq_len=24, tiers=(host,), pins=pins)
        control = pinned(600) if pins else None
        turn(m, agent, cache_control=control)
        # every device page is room: the pinned pages are in the host tier, which keeps them
        assert m.metrics.free_pages == 6
        storm(m, 100, 5)  # requests of every device page: the host tier cycles too
        assert found(m, nxt) == expected
        if pins is not None:
            assert m.metrics.cache_control.spilled_pages == 2
            assert m.metrics.host_cache_tokens == 8
        m.check_invariants()


def sessions_and_pins(session, num_pages, max_seq_len):
    """A manager with sessions and pins on one clock, and the clock."""
    clock = Clock()
    m = make_paged(
        session,
        num_pages=num_pages,
        max_seq_len=max_seq_len,
        sessions=SessionConfig(clock=clock),
        pins=PinConfig(clock=clock),
    )
    return m, clock


def test_a_session_pins_its_context_when_it_pauses(session):
    m, clock = sessions_and_pins(session, num_pages=12, max_seq_len=24)
    agent = np.arange(9)
    turn(m, agent, "agent")
    assert m.pin_session("agent", 3600) == mokv.PinGrant(8, 8, 3600.0)
    assert m.pin_session("nobody", 60) == mokv.PinGrant(0, 0, -math.inf)
    clock.now = 1000.0  # past the session's 300 s: it ends, the pin holds its pages
    storm(m, 100, 3)
    assert found(m, np.r_[agent, [1, 50]]) == 8
    assert m.metrics.sessions.expired == 1
    m.check_invariants()


def test_a_session_pin_holds_only_pages_still_held(session):
    """Retention orders evictions, it does not prevent them: a session's chain whose
    pages are gone everywhere pins nothing (such a pin counted against the budget and
    reported tokens that nothing held; hypothesis found it, PinMachine)."""
    m, _ = sessions_and_pins(session, num_pages=8, max_seq_len=32)
    turn(m, np.arange(9), "agent")
    storm(m, 100, 7)  # requests of all eight pages: the kept ones go too
    assert sessions(m).retained("agent") == hashes(np.arange(8))
    assert m.pin_session("agent", 60) == mokv.PinGrant(8, 0, -math.inf)
    assert not m.replicas[0].pins.pins and m.metrics.cache_control.refused == 1
    turn(m, np.arange(5), "agent")  # the first page again: a pin takes it alone
    assert m.pin_session("agent", 60) == mokv.PinGrant(8, 4, 60.0)
    assert m.replicas[0].pool.num_pinned == 1
    m.check_invariants()


def test_write_policies(session):
    prompt = np.arange(17)  # four full pages
    for control, committed in (
        (None, 4),
        (CacheControl(write="all"), 4),
        (CacheControl(write="prefix", write_limit_tokens=9), 2),
        (CacheControl(write="read_only"), 0),
    ):
        m = make_paged(session, num_pages=12, max_seq_len=32)
        turn(m, prompt, cache_control=control)
        assert m.replicas[0].pool.num_cached == committed
        assert m.metrics.cache_control.withheld_pages == 4 - committed
        assert found(m, np.r_[prompt, [3]]) == 4 * committed
        m.check_invariants()


def test_a_read_only_request_uses_hits_and_writes_nothing_to_any_tier(session):
    page_bytes = small_params().bytes_per_page(NUM_LAYERS)
    host = mokv.HostTierConfig(swap_space_gb=8 * page_bytes / 2**30)
    m = make_paged(session, num_pages=8, max_seq_len=32, tiers=(host,))
    turn(m, np.arange(9))  # two pages, in the device and the host tier
    stored = m.metrics.tiers["host"].used_pages
    ctx = turn(m, np.arange(21), cache_control=CacheControl(write="read_only"))
    assert ctx.start_idx == 21  # it ran, starting at its hit
    assert m.metrics.cache_tokens == 8
    assert m.metrics.tiers["host"].used_pages == stored == 2
    assert m.replicas[0].pool.num_cached == 2
    assert m.metrics.cache_control.withheld_pages == 3
    m.check_invariants()


def test_bad_cache_control_is_refused_by_name_and_changes_nothing(session):
    with pytest.raises(ValueError, match="pin_ttl_s"):
        CacheControl(pin_ttl_s=0)
    with pytest.raises(ValueError, match="write"):
        CacheControl(write="some")
    with pytest.raises(ValueError, match="write_limit_tokens"):
        CacheControl(write="prefix")
    with pytest.raises(ValueError, match="write_limit_tokens"):
        CacheControl(write_limit_tokens=4)
    with pytest.raises(ValueError, match="max_share"):
        PinConfig(max_share=0)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        small_params(enable_prefix_caching=False, pins=PinConfig())
    with pytest.raises(TypeError, match="cache_control"):
        TextContext([1, 2], cache_control={"type": "ephemeral"})
    m = make_paged(session, num_pages=8)  # no pins configured
    ctx = TextContext(np.arange(9), cache_control=pinned(60))
    m.external_claim(ctx.request_id)
    with pytest.raises(ValueError, match="KVCacheParams.pins"):
        m.maybe_reserve(ctx)
    assert ctx.start_idx == 0 and m.replicas[0].pool.num_used == 0
    with pytest.raises(ValueError, match="KVCacheParams.pins"):
        m.pin(ctx.request_id, 60)
    p = make_paged(session, num_pages=8, pins=PinConfig())
    ctx = TextContext(np.arange(9))
    p.external_claim(ctx.request_id)
    with pytest.raises(ValueError, match="pin_ttl_s"):
        p.pin(ctx.request_id, -1)
    m.check_invariants()
    p.check_invariants()


def test_reset_prefix_cache_ends_every_pin(session):
    page_bytes = small_params().bytes_per_page(NUM_LAYERS)
    host = mokv.HostTierConfig(swap_space_gb=8 * page_bytes / 2**30)
    m = make_paged(session, num_pages=8, tiers=(host,), pins=PinConfig())
    turn(m, np.arange(9), cache_control=pinned(60))
    assert m.reset_prefix_cache()
    assert not m.replicas[0].pins.pins and m.replicas[0].pool.num_pinned == 0
    assert m.metrics.free_pages == 8
    m.check_invariants()


def test_reset_prefix_cache_goes_ahead_beside_a_pin_no_tier_can_take(session):
    """Without a host tier a pinned page is not room, yet no request holds it: the reset
    goes ahead (it refused while any page was not room; hypothesis found it)."""
    m = make_paged(session, num_pages=8, pins=PinConfig())
    turn(m, np.arange(9), cache_control=pinned(60))
    assert m.metrics.free_pages == 6
    assert m.reset_prefix_cache()
    assert not m.replicas[0].pins.pins and m.metrics.free_pages == 8
    m.check_invariants()


def test_write_policies_reach_the_shared_tier(session, redis_server):  # noqa: F811
    """A read-only request writes nothing to Redis; a prefix-only one its first pages."""
    prompt = np.r_[np.arange(8), [9]]  # two full pages
    for control, written in ((CacheControl(write="read_only"), 0),
                             (CacheControl(write="prefix", write_limit_tokens=4), 1),
                             (None, 2)):
        m = remote_manager(session, redis_server, fresh_namespace())
        serve(m, TextContext(prompt, "A", cache_control=control))
        flush(m)
        assert m.remote_metrics.pages_written == written
        assert m.metrics.cache_control.withheld_pages == 2 - written
        m.check_invariants()
        m.close()


def test_a_cache_of_groups_pins_whole_chains_and_a_windows_tail(session):
    """On a sliding group (window 6: two pages before the one written) beside a full one,
    a pin holds its whole chain in the full group and the two pages before its end in
    the window's: pressure never evicts them, the next request finds the whole prefix,
    renewing the pin; at its deadline every group lets go. A window's budget
    refuses a pin whose tail it cannot hold."""
    groups = (mokv.CacheGroupConfig("sliding", 1, window_size=6),
              mokv.CacheGroupConfig("full", 1, n_kv_heads=1))  # half the sliding page
    clock = Clock()
    m = make_paged(session, num_pages=16, max_seq_len=32, groups=groups,
                   pins=PinConfig(max_share=0.25, clock=clock))
    sliding, full = (g.pool for g in m.replicas[0].groups)
    turn(m, np.arange(17), cache_control=pinned(300))
    chain = hashes(np.arange(16))
    assert full.pinned_hashes == set(chain) and sliding.pinned_hashes == set(chain[2:])
    for i in range(4):
        turn(m, np.arange(15) + 1000 * (i + 1))  # 4 pages each, committed and released
        m.check_invariants()
    assert set(chain) <= full.indexed_hashes()
    assert set(chain[2:]) <= sliding.indexed_hashes()
    clock.now = 299.0
    assert found(m, np.r_[np.arange(16), [5]]) == 16
    (pin,) = m.replicas[0].pins.pins.values()
    assert pin.deadline == 599.0
    c = m.metrics.cache_control
    assert (c.pins, c.pinned_pages, c.pinned_device_pages) == (1, 4, 4 + 2)
    # Budgets: a quarter of each group's half of the shared memory, the full group's for
    # whole chains, the window's for tails; a full page is half a sliding one, so the
    # full group's budget has twice the pages. One-page chains: the window refuses first.
    budgets = make_paged(session, num_pages=16, max_batch_size=8, max_seq_len=32, groups=groups,
                         pins=PinConfig(max_share=0.25, clock=clock))
    w_pool, f_pool = (g.pool for g in budgets.replicas[0].groups)
    table = budgets.replicas[0].pins
    k = table.group_cap(w_pool)
    assert (k, table.cap) == (w_pool.num_pages // 2 // 4, f_pool.num_pages // 2 // 4)
    assert table.cap == 2 * k
    grants = [budgets.pin(turn_held(budgets, np.arange(5) + 100 * i), 300.0).pinned_tokens
              for i in range(k + 1)]
    assert grants == [4] * k + [0] and len(w_pool.pinned_hashes) == k
    assert budgets.metrics.cache_control.refused == 1
    budgets.check_invariants()
    clock.now = 10_000.0
    found(m, np.arange(5) + 7000)  # a reservation ends the pins past their deadline
    assert not full.pinned_hashes and not sliding.pinned_hashes
    m.check_invariants()


def turn_held(m, tokens) -> str:
    """A request of `tokens`, prefilled and stepped once, still held: its id."""
    ctx = TextContext(np.asarray(tokens))
    m.external_claim(ctx.request_id)
    m.fetch([ctx])
    ctx.update(1)
    m.step([ctx])
    return ctx.request_id
