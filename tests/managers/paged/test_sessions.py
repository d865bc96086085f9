"""Sessions (`KVCacheParams.sessions`): a released request's pages stay retained for its
session, evicted only after every unretained page, on the device and in the host tier,
until `end_session`, the time-to-live or the share cap; retention never makes a
reservation fail."""

import mokv
import numpy as np
import pytest
from mokv import SessionConfig, TextContext
from mokv.events import PrefixRouterIndex

from ..conftest import NUM_LAYERS, make_paged, small_params


class Clock:
    """An injectable `SessionConfig.clock`."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def turn(m, tokens, session_id=None, request_id=None, cache_control=None) -> TextContext:
    """One whole request: prefill, one token, commit, release."""
    ctx = TextContext(np.asarray(tokens), request_id, session_id=session_id,
                      cache_control=cache_control)
    m.external_claim(ctx.request_id)
    m.fetch([ctx])
    ctx.update(1)
    m.step([ctx])
    m.release(ctx.request_id)
    return ctx


def found(m, tokens, session_id=None) -> int:
    """Tokens of a new request the prefix cache supplies (reserved, then released)."""
    ctx = TextContext(np.asarray(tokens), session_id=session_id)
    m.external_claim(ctx.request_id)
    assert m.maybe_reserve(ctx)
    m.release(ctx.request_id)
    return ctx.start_idx


def storm(m, first, pages) -> None:
    """Unrelated requests that commit `pages` pages each, twice over the pool."""
    for i in range(2 * m.total_num_pages // pages):
        turn(m, np.arange(pages * 4 + 1) + first + 1000 * i)


def sessions(m, replica=0):
    return m.replicas[replica].sessions


def hashes(tokens) -> tuple[int, ...]:
    """The chain of the full pages of `tokens` (unsalted), as the manager hashes it."""
    return tuple(PrefixRouterIndex(page_size=4).page_hashes(tokens))


def test_a_session_keeps_its_pages_through_a_pause_where_lru_loses_them(session):
    agent = np.arange(9)  # two full pages
    for config, expected in ((SessionConfig(), 8), (None, 0)):
        m = make_paged(session, num_pages=12, max_seq_len=24, sessions=config)
        turn(m, agent, "agent-1")
        storm(m, 100, 3)  # a tool call: other traffic cycles the pool twice
        nxt = np.r_[agent, [1, 50, 51, 52]]  # the answer, then the tool's output
        assert found(m, nxt, "agent-1") == expected
        m.check_invariants()
    s = m.metrics.sessions  # without sessions: all zero
    assert s == mokv.SessionMetrics()
    m = make_paged(session, num_pages=12, max_seq_len=24, sessions=SessionConfig())
    turn(m, agent, "agent-1")
    storm(m, 100, 3)
    assert found(m, np.r_[agent, [1, 50, 51, 52]], "agent-1") == 8
    s = m.metrics.sessions
    assert (s.sessions, s.retained_pages, s.kept_pages, s.turns, s.turn_hits) == (1, 2, 2, 1, 1)
    assert (s.turn_prompt_tokens, s.turn_cache_tokens, s.evicted_pages) == (13, 8, 0)
    assert s.turn_hit_rate == 8 / 13
    assert sessions(m).retained("agent-1") == hashes(agent[:8])  # found, not committed


def test_unretained_pages_are_evicted_first_and_retention_never_fails_a_reservation(session):
    m = make_paged(session, num_pages=8, max_seq_len=32, sessions=SessionConfig())
    pool = m.replicas[0].pool
    turn(m, np.arange(9), "s")  # its 2 full pages are retained (the third page was free)
    turn(m, np.arange(50, 59))  # 2 more cached pages, not retained, younger
    kept = {h: pool.lookup(h, b) for h, b in
            zip(sessions(m).retained("s"), [np.arange(4).tobytes(), np.arange(4, 8).tobytes()])}
    assert pool.num_kept == 2 and pool.num_cached == 4
    ctx = TextContext(np.arange(200, 221))  # 6 pages: 4 free, then 2 evicted
    m.external_claim(ctx.request_id)
    assert m.maybe_reserve(ctx)
    assert pool.num_kept == 2 and pool.num_cached == 2  # the unretained pages went first
    assert all(pool.page_hash(p) == h for h, p in kept.items())
    ctx2 = TextContext(np.arange(300, 308))  # 2 more pages: only the kept ones are left
    m.external_claim(ctx2.request_id)
    assert m.maybe_reserve(ctx2)  # retention changes the order, never the room
    assert pool.num_free == 0 and m.metrics.sessions.evicted_pages == 2
    for c in (ctx, ctx2):
        m.release(c.request_id)
    assert found(m, np.r_[np.arange(9), [1, 5]], "s") == 0  # lost, and counted


def test_a_retained_page_is_still_shared_by_prefix(session):
    m = make_paged(session, num_pages=12, max_seq_len=24, sessions=SessionConfig())
    turn(m, np.arange(9), "s")
    assert found(m, np.arange(10)) == 8  # another request, no session, shares it
    pool = m.replicas[0].pool
    assert pool.num_kept == 2  # back to kept once that request let go


def test_end_session_releases_exactly_its_retention(session):
    m = make_paged(session, num_pages=16, max_seq_len=32, sessions=SessionConfig())
    system = list(range(8))  # a prompt both sessions start with: retained once
    turn(m, system + [20, 21, 22, 23, 1], "a")
    turn(m, system + [30, 31, 32, 33, 1], "b")
    table, pool = sessions(m), m.replicas[0].pool
    a, b = table.retained("a"), table.retained("b")
    assert a[:2] == b[:2] and a[2] != b[2]
    assert pool.retained_hashes == set(a) | set(b) and len(table.retained_hashes) == 4
    assert m.end_session("a") == 1  # only its own third page: the system pages stay
    assert pool.retained_hashes == set(b) and table.retained("a") == ()
    assert m.metrics.sessions.ended == 1 and m.metrics.sessions.sessions == 1
    assert pool.num_kept == 3 and pool.num_cached == 4
    # Its page is now the first to go, before the other unretained page (older).
    turn(m, [90, 91, 92, 93, 94], "c")  # nothing evicted: free pages remain
    assert m.end_session("a") == 0 and m.end_session("never") == 0
    with pytest.raises(TypeError, match="session_id must be a non-empty str, got 5"):
        m.end_session(5)
    assert m.end_session("b") == 3 and pool.retained_hashes == {*table.retained("c")}
    m.check_invariants()


def test_an_ended_sessions_pages_go_before_any_other_cached_page(session):
    m = make_paged(session, num_pages=6, max_seq_len=24, sessions=SessionConfig())
    pool = m.replicas[0].pool
    turn(m, np.arange(50, 59))  # 2 cached pages, released first: the oldest
    turn(m, np.arange(9), "s")  # 2 pages, retained
    m.end_session("s")
    ctx = TextContext(np.arange(200, 213))  # 4 pages: 2 free, then 2 evicted
    m.external_claim(ctx.request_id)
    assert m.maybe_reserve(ctx)
    m.release(ctx.request_id)
    assert pool.num_cached == 2  # the older pages (ctx committed nothing)
    assert found(m, np.arange(50, 60)) == 8 and found(m, np.arange(10)) == 0


def test_time_to_live(session):
    clock = Clock()
    m = make_paged(session, num_pages=16, max_seq_len=24,
                   sessions=SessionConfig(ttl_s=10.0, clock=clock))
    turn(m, np.arange(9), "s")
    clock.now = 9.5
    turn(m, np.arange(100, 105))  # a reservation: the session is not due yet
    assert sessions(m).retained("s") and m.metrics.sessions.expired == 0
    clock.now = 10.0
    turn(m, np.arange(200, 205))
    assert sessions(m).retained("s") == () and m.metrics.sessions.expired == 1
    assert m.replicas[0].pool.retained_hashes == frozenset()
    # A session with a request running never expires; its deadline starts at the release.
    ctx = TextContext(np.arange(9), session_id="long")
    m.external_claim(ctx.request_id)
    m.fetch([ctx])
    clock.now = 100.0
    ctx.update(1)
    m.step([ctx])
    turn(m, np.arange(300, 305))
    m.release(ctx.request_id)
    assert len(sessions(m).retained("long")) == 2
    clock.now = 109.0
    turn(m, np.arange(400, 405))
    assert len(sessions(m).retained("long")) == 2
    clock.now = 110.0
    turn(m, np.arange(500, 505))
    assert sessions(m).retained("long") == () and m.metrics.sessions.expired == 2
    m.check_invariants()


def test_the_share_cap_drops_the_least_recently_used_session_first(session):
    m = make_paged(session, num_pages=16, max_seq_len=32, sessions=SessionConfig(max_share=0.25))
    table = sessions(m)
    assert table.cap == 4
    turn(m, np.arange(9), "a")
    turn(m, np.arange(100, 109), "b")
    assert len(table.retained_hashes) == 4
    turn(m, np.arange(200, 209), "c")  # past the cap: "a" (least recently used) goes
    assert table.retained("a") == () and len(table.retained("b")) == 2
    assert len(table.retained("c")) == 2 and m.metrics.sessions.dropped == 1
    assert m.metrics.sessions.sessions == 3  # "a" stays open, retaining nothing
    turn(m, np.arange(9), "b")  # b's next chain replaces its old one
    assert table.retained("b") == hashes(np.arange(8)) and m.metrics.sessions.dropped == 1
    turn(m, np.arange(300, 325), "d")  # 6 full pages: only its first 4 are retained
    assert table.retained("d") == hashes(np.arange(300, 316))
    assert table.retained("c") == table.retained("b") == ()  # both older than d
    assert table.retained_hashes == set(hashes(np.arange(300, 316)))
    assert m.metrics.sessions.dropped == 3
    m.check_invariants()


def test_a_shorter_release_of_a_session_keeps_its_longer_chain(session):
    m = make_paged(session, num_pages=16, max_seq_len=32, sessions=SessionConfig())
    turn(m, np.arange(13), "s")  # 3 pages
    before = sessions(m).retained("s")
    ctx = TextContext(np.arange(13), session_id="s")  # the next turn, preempted early
    m.external_claim(ctx.request_id)
    ctx.chunk(5)
    assert m.maybe_reserve(ctx) and ctx.start_idx == 12
    m.release(ctx.request_id)
    assert sessions(m).retained("s") == before


def test_a_session_ended_while_its_request_runs_retains_nothing_on_release(session):
    m = make_paged(session, num_pages=16, max_seq_len=24, sessions=SessionConfig())
    ctx = TextContext(np.arange(9), session_id="s")
    m.external_claim(ctx.request_id)
    m.fetch([ctx])
    ctx.update(1)
    m.step([ctx])
    assert m.end_session("s") == 0  # nothing retained yet
    turn(m, np.arange(100, 109), "s")  # a new session of the same name opens
    m.release(ctx.request_id)
    assert sessions(m).retained("s") == hashes(np.arange(100, 108))  # not ctx's pages
    assert m.replicas[0].pool.retained_hashes == set(hashes(np.arange(100, 108)))


def test_host_tier_evicts_unretained_pages_first(session):
    page_bytes = small_params().bytes_per_page(NUM_LAYERS)
    host = mokv.HostTierConfig(swap_space_gb=8 * page_bytes / 2**30)
    agent = np.arange(9)
    for config, expected in ((SessionConfig(), 8), (None, 0)):
        m = make_paged(session, num_pages=6, max_seq_len=24, tiers=(host,), sessions=config)
        turn(m, agent, "agent")
        storm(m, 100, 5)  # requests of every device page: the host tier cycles too
        assert found(m, np.r_[agent, [1, 7]], "agent") == expected
        if config is not None:
            s = m.metrics.sessions
            assert s.kept_host_pages == 2 and s.evicted_pages == 2  # gone from the device
            assert m.metrics.host_cache_tokens == 8
        m.check_invariants()


def test_reset_prefix_cache_ends_every_session(session):
    m = make_paged(session, num_pages=16, max_seq_len=24, sessions=SessionConfig())
    turn(m, np.arange(9), "s")
    assert m.reset_prefix_cache()
    s = m.metrics.sessions
    assert (s.sessions, s.retained_pages, s.kept_pages, s.ended) == (0, 0, 0, 1)
    m.check_invariants()


def test_sessions_over_two_replicas(session):
    m = make_paged(session, num_pages=8, max_seq_len=24, data_parallel_degree=2, n_devices=2,
                   sessions=SessionConfig())
    for replica in (0, 1):
        ctx = TextContext(np.arange(9) + 10 * replica, session_id="s")
        m.external_claim(ctx.request_id, replica)
        m.fetch([ctx])
        ctx.update(1)
        m.step([ctx])
        m.release(ctx.request_id)
    assert m.metrics.sessions.sessions == 2 and m.metrics.sessions.retained_pages == 4
    assert m.end_session("s") == 4 and m.metrics.sessions.sessions == 0


def test_config_is_checked():
    for kwargs, error, match in [
        (dict(ttl_s=0), ValueError, "ttl_s must be a number of seconds > 0, got 0"),
        (dict(ttl_s=float("nan")), ValueError, "ttl_s"),
        (dict(ttl_s="5"), ValueError, "'5'"),
        (dict(max_share=0), ValueError, r"max_share must be a number in \(0, 1\], got 0"),
        (dict(max_share=1.5), ValueError, "1.5"),
        (dict(clock=3), TypeError, "clock must be callable, got 3"),
    ]:
        with pytest.raises(error, match=match):
            SessionConfig(**kwargs)
    assert SessionConfig(ttl_s=float("inf"), max_share=1).cap(10) == 10
    with pytest.raises(ValueError, match="SessionConfig needs enable_prefix_caching"):
        small_params(enable_prefix_caching=False, sessions=SessionConfig())
    with pytest.raises(TypeError, match="sessions must be a mokv.SessionConfig or None, got 'x'"):
        small_params(sessions="x")
    assert small_params(sessions=SessionConfig(clock=Clock())) == small_params(
        sessions=SessionConfig())


def test_a_dropped_session_falls_back_to_plain_lru_as_if_just_released(session):
    m = make_paged(session, num_pages=16, max_seq_len=48, sessions=SessionConfig(max_share=0.25))
    turn(m, np.arange(50, 59))  # 2 cached pages of no session: the oldest
    turn(m, np.arange(9), "a")
    turn(m, np.arange(100, 109), "b")
    turn(m, np.arange(200, 209), "c")  # the cap drops "a": its pages become cached, young
    assert sessions(m).retained("a") == () and m.replicas[0].pool.num_kept == 4
    ctx = TextContext(np.arange(300, 337))  # 10 pages: the 8 free, then 2 cached evicted
    m.external_claim(ctx.request_id)
    assert m.maybe_reserve(ctx)
    m.release(ctx.request_id)
    assert found(m, np.arange(10)) == 8 and found(m, np.arange(50, 60)) == 0


def test_a_cache_of_groups_retains_whole_chains_and_a_windows_tail(session):
    """On a sliding group (window 6: two pages before the one written) beside a full one,
    a session retains its whole chain in the full group and only the two pages before
    its end in the window's: the next turn's joint hit reads no more there. Unrelated
    requests evict everything else; the turn after finds the whole chain on the device."""
    groups = (mokv.CacheGroupConfig("sliding", 1, window_size=6),
              mokv.CacheGroupConfig("full", 1))
    m = make_paged(session, num_pages=16, max_seq_len=32, groups=groups,
                   sessions=SessionConfig(max_share=0.5))
    sliding, full = (g.pool for g in m.replicas[0].groups)
    first = turn(m, np.arange(17), session_id="s", request_id="A")
    chain = hashes(first.tokens[:16])
    assert sessions(m).retained("s") == chain and len(chain) == 4
    assert full.retained_hashes == set(chain)
    assert sliding.retained_hashes == set(chain[2:])
    storm(m, 100, 3)
    assert set(chain) <= full.indexed_hashes()
    assert set(chain[2:]) <= sliding.indexed_hashes() and not set(chain[:2]) & sliding.indexed_hashes()
    assert found(m, np.r_[np.arange(16), [5]], session_id="s") == 16
    second = turn(m, np.r_[np.arange(16), np.arange(50, 55)], session_id="s", request_id="B")
    longer = hashes(second.tokens[:20])
    assert sessions(m).retained("s") == longer
    assert full.retained_hashes == set(longer)
    assert sliding.retained_hashes == set(longer[3:])  # the tail moved with the chain
    assert m.end_session("s") == 5
    assert not full.retained_hashes and not sliding.retained_hashes
    m.check_invariants()
