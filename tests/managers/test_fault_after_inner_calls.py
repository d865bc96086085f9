"""The cases of issue 41 where an exception raised right after an inner call returned
broke all-or-nothing (what a `KeyboardInterrupt`, a `MemoryError` or a failing callback
do), one test each: pages leaked after `PagePool.take`, retries of `step` failing after
`commit_pages`, reference counts after `PagePool.release`, request ids stuck after the
replica's `release` / `claim`, `StaleContextError` after `skip_cached_prefix` moved the
context; and the two edges the rollback keeps (a moved context's reservation stands)."""

from __future__ import annotations

import mokv
import numpy as np
import pytest
from mokv import TextContext
from mokv.cache.page_pool import PagePool
from mokv.managers.paged.inputs import PageTable
from mokv.managers.paged.replica import PagedReplica
from mokv.tiers.host import HostTier

from .conftest import NUM_LAYERS, make_paged, small_params
from .faults import Faults, Injected

NUM_PAGES = 12
PREFIX = list(range(1, 9))  # two full pages of 4 tokens


def fault(monkeypatch, owner, name: str, mode: str = "after", when: int = 1) -> None:
    """The `when`-th call of `owner.name` raises `Injected`, after it returned (mode
    "after") or instead of running ("instead")."""
    Faults(monkeypatch, [(owner, name)]).arm(when, mode)


def manager(session, **overrides):
    return make_paged(session, num_pages=NUM_PAGES, max_seq_len=24, **overrides)


def served(m, ctx: TextContext) -> None:
    """Claims, fetches and steps `ctx` once (its full pages committed)."""
    m.external_claim(ctx.request_id)
    m.fetch([ctx])
    ctx.update(1)
    m.step([ctx])


def with_a_cached_prefix(session):
    """A manager whose request A committed PREFIX (two pages) and was released."""
    m = manager(session)
    served(m, TextContext(PREFIX + [9], "A"))
    m.release("A")
    return m


def all_back(m) -> None:
    """Every request released: every page and slot is back, every invariant holds."""
    m.check_invariants()
    assert m.num_free_blocks == NUM_PAGES
    assert m.replicas[0].num_free_slots == m.replicas[0].max_requests


@pytest.mark.parametrize("call", ["maybe_reserve", "fetch"])
def test_no_page_leaks_after_take_returns(session, monkeypatch, call):
    m = manager(session)
    a = TextContext(np.arange(9), "A")
    m.external_claim("A")
    reserve = (lambda: m.maybe_reserve(a)) if call == "maybe_reserve" else (lambda: m.fetch([a]))
    fault(monkeypatch, PagePool, "take")
    with pytest.raises(Injected):
        reserve()
    m.check_invariants()  # was: "page 0 (owned) has ref count 1 but 0 owners"
    assert m.num_free_blocks == NUM_PAGES and m.get_req_blocks("A") == []
    reserve()  # the retry succeeds
    assert len(m.get_req_blocks("A")) == 3
    m.release("A")
    all_back(m)


@pytest.mark.parametrize("owner, name", [(PagePool, "take"), (PageTable, "set_row")])
def test_a_decode_step_onto_a_new_page_gives_it_back(session, monkeypatch, owner, name):
    m = manager(session)
    a = TextContext(np.arange(8), "A")
    served(m, a)  # two full pages, committed; the token after them needs a third
    assert m.replicas[0].planner.takes_fresh_only(a, m.replicas[0]._requests["A"])  # `grow`
    before = m.get_req_blocks("A"), m.num_free_blocks
    fault(monkeypatch, owner, name)
    with pytest.raises(Injected):
        m.maybe_reserve(a)
    m.check_invariants()
    assert (m.get_req_blocks("A"), m.num_free_blocks) == before
    assert m.maybe_reserve(a) and len(m.get_req_blocks("A")) == 3  # the retry succeeds
    m.release("A")
    all_back(m)


def test_step_retries_after_commit_pages_returned(session, monkeypatch):
    m = manager(session)
    a = TextContext(np.arange(9), "A")
    m.external_claim("A")
    m.fetch([a])
    a.update(1)
    fault(monkeypatch, PagePool, "commit_pages")
    with pytest.raises(Injected):
        m.step([a])
    assert m.replicas[0].committed_hashes("A") == []  # nothing committed
    m.step([a])  # was: InvariantError, "committed while unowned or already hashed"
    assert len(m.replicas[0].committed_hashes("A")) == 2
    m.release("A")
    all_back(m)


def test_reference_counts_hold_after_release_returned(session, monkeypatch):
    m = manager(session)
    a, b = TextContext(PREFIX + [9], "A"), TextContext(PREFIX + [7], "B")
    served(m, a)
    m.external_claim("B")
    assert m.maybe_reserve(b) and b.start_idx == 8  # B shares A's two pages
    fault(monkeypatch, PagePool, "release")
    with pytest.raises(Injected):
        m.release("A")
    m.check_invariants()  # was: reference counts below the owners
    assert m.contains("A") and m.replicas[0].pool.ref_count(m.get_req_blocks("B")[0]) == 2
    m.release("A")
    m.release("B")
    all_back(m)


def test_a_request_is_never_stuck_after_the_replicas_release(session, monkeypatch):
    m = manager(session)
    served(m, TextContext(np.arange(9), "A"))
    fault(monkeypatch, PagedReplica, "release")
    with pytest.raises(Injected):
        m.release("A")
    assert m.contains("A")  # the old state: still claimed, and releasable
    m.release("A")  # was: UnknownRequestError, for ever
    assert not m.contains("A")
    m.external_claim("A")
    m.release("A")
    all_back(m)


def test_no_hidden_slot_after_the_replicas_claim(session, monkeypatch):
    m = manager(session)
    fault(monkeypatch, PagedReplica, "claim")
    with pytest.raises(Injected):
        m.external_claim("A")
    assert not m.contains("A")
    m.external_claim("A")  # was: AlreadyClaimedError (a slot held by no one)
    m.release("A")
    all_back(m)


def test_a_moved_context_keeps_its_reservation(session, monkeypatch):
    m = with_a_cached_prefix(session)
    b = TextContext(PREFIX + [7, 7], "B")
    m.external_claim("B")
    fault(monkeypatch, TextContext, "skip_cached_prefix")
    with pytest.raises(Injected):
        m.maybe_reserve(b)
    assert b.start_idx == 8 and len(m.get_req_blocks("B")) == 3  # the new state
    assert m.maybe_reserve(b)  # was: StaleContextError (the window past the pages)
    m.fetch([b])
    m.release("B")
    all_back(m)


def test_a_context_that_did_not_move_gives_everything_back(session, monkeypatch):
    """`skip_cached_prefix` raised before moving: the old state, evicted pages included."""
    m = with_a_cached_prefix(session)
    for rid, first in (("C", 100), ("D", 200)):  # 4 full pages each
        served(m, TextContext(np.arange(first, first + 17), rid))
        m.release(rid)
    pool = m.replicas[0].pool
    cached = {p: pool.page_hash(p) for p in range(NUM_PAGES) if pool.is_cached(p)}
    assert len(cached) == 10  # and 2 free pages
    b = TextContext(PREFIX + list(range(50, 65)), "B")  # 2 hits + 4 fresh: evicts 2 cached
    m.external_claim("B")
    fault(monkeypatch, TextContext, "skip_cached_prefix", "instead")
    with pytest.raises(Injected):
        m.maybe_reserve(b)
    assert {p: pool.page_hash(p) for p in range(NUM_PAGES) if pool.is_cached(p)} == cached
    assert b.start_idx == 0 and m.get_req_blocks("B") == []
    assert m.maybe_reserve(b) and b.start_idx == 8
    m.release("B")
    all_back(m)


def test_in_a_batch_the_contexts_that_moved_keep_their_reservations(session, monkeypatch):
    """Two prefix hits in one fetch; the second context's `skip_cached_prefix` raises
    before moving: the first keeps its reservation, the second gets none; a retry of the
    fetch reserves the second."""
    m = with_a_cached_prefix(session)
    b, c = TextContext(PREFIX + [7], "B"), TextContext(PREFIX + [5, 5], "C")
    for ctx in (b, c):
        m.external_claim(ctx.request_id)
    fault(monkeypatch, TextContext, "skip_cached_prefix", "instead", when=2)
    with pytest.raises(Injected):
        m.fetch([b, c])
    assert (b.start_idx, len(m.get_req_blocks("B"))) == (8, 3)
    assert (c.start_idx, m.get_req_blocks("C")) == (0, [])
    m.check_invariants()
    m.fetch([b, c])
    assert (c.start_idx, len(m.get_req_blocks("C"))) == (8, 3)
    m.release("B")
    m.release("C")
    all_back(m)


def test_a_failed_load_leaves_the_reservation_of_fetch_standing(session, monkeypatch):
    """With the host tier: the reservation stands once the context moved; the loads stay
    pending, and the next fetch runs them."""
    page_bytes = small_params().bytes_per_page(NUM_LAYERS)
    m = make_paged(
        session,
        num_pages=6,
        max_seq_len=24,
        tiers=(mokv.HostTierConfig(swap_space_gb=10 * page_bytes / 2**30),),
    )
    served(m, TextContext(PREFIX + [9], "A"))  # written through to the host
    m.release("A")
    served(m, TextContext(np.arange(100, 121), "C"))  # evicts A's pages from the device
    m.release("C")
    b = TextContext(PREFIX + [7], "B")
    m.external_claim("B")
    fault(monkeypatch, HostTier, "load")
    with pytest.raises(Injected):
        m.fetch([b])
    assert b.start_idx == 8
    assert [name for name, _, _ in m.replicas[0].pending_loads("B")] == ["host", "host"]
    m.check_invariants()
    m.fetch([b])
    assert not m.replicas[0].pending_loads("B") and m.metrics.host_cache_tokens == 8
    m.release("B")
    m.check_invariants()
    assert m.num_free_blocks == 6


def test_nothing_recorded_outlives_its_call(session, monkeypatch):
    """Each public call closes its undo bracket, whether it returns or raises: the log
    is empty after it (else the records of finished calls would pile up for ever)."""
    m = manager(session)
    a = TextContext(np.arange(9), "A")
    m.external_claim("A")
    assert len(m._undo) == 0
    with pytest.raises(mokv.AlreadyClaimedError):
        m.external_claim("A")
    assert len(m._undo) == 0
    m.fetch([a])
    a.update(1)
    m.step([a])
    assert len(m._undo) == 0
    fault(monkeypatch, PagedReplica, "release")
    with pytest.raises(Injected):
        m.release("A")
    assert len(m._undo) == 0
    m.release("A")
    assert len(m._undo) == 0
    all_back(m)
