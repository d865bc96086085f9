"""The host-memory tier in the paged manager: pins, the manager's promises (False
changes nothing in either tier; after True, fetch cannot fail), write-through,
min_hits, metrics, and bit-exact round trips on two TP shards."""

import mokv
import numpy as np
import pytest
from max.dtype import DType
from mokv import TextContext
from mokv.cache import page_copy
from mokv.cache.hashing import page_hash_fn, page_hashes, root_hash

from ..managers.conftest import NUM_LAYERS, make_paged, mla, small_params


def host_options(num_host_pages: int, min_hits: int = 0, **overrides) -> dict:
    params = small_params(**overrides)
    gb = params.data_parallel_degree * num_host_pages * params.bytes_per_page(NUM_LAYERS) / 2**30
    return dict(overrides, tiers=(mokv.HostTierConfig(swap_space_gb=gb, min_hits=min_hits),))


def make_host(session, num_pages=6, num_host_pages=10, **overrides):
    return make_paged(session, num_pages=num_pages, max_seq_len=24,
                      **host_options(num_host_pages, **overrides))


def host_tier(m, replica=0):
    return m.replicas[replica].tiers.named("host")


def evict_from_device(m, tokens=range(100, 121), rid="X"):
    """A 21-token request fills all 6 device pages: every cached device page is evicted."""
    x = TextContext(np.array(tokens), rid)
    m.external_claim(rid)
    m.fetch([x])
    x.update(1)
    m.step([x])
    m.release(rid)


def cached_on_host_only(m):
    """Request A (tokens 0-8) commits pages 0-1, written through to the host tier; then
    every cached device page is evicted, so a request on A's prefix gets two host hits."""
    a = TextContext(np.arange(9), "A")
    m.external_claim("A")
    m.fetch([a])
    a.update(1)
    m.step([a])
    m.release("A")
    evict_from_device(m)


def test_host_hits_are_pinned_and_loaded_by_fetch(session):
    m = make_host(session, num_host_pages=7)  # A's 2 pages + X's 5: full
    cached_on_host_only(m)  # pages 0-1 committed and written through, then evicted
    b = TextContext(np.r_[np.arange(8), [5]], "B")
    m.external_claim("B")
    assert m.maybe_reserve(b) and b.start_idx == 8
    tier = host_tier(m)
    pinned = tier.pinned
    assert len(pinned) == 2
    assert [(name, h) for name, _, h in m.replicas[0].pending_loads("B")] == [
        ("host", tier.pool.page_hash(p)) for p in sorted(pinned)]
    hashes = {tier.pool.page_hash(p) for p in pinned}
    evict_from_device(m, range(200, 211), "Y")  # 2 more pages: the host tier evicts
    assert {tier.pool.page_hash(p) for p in pinned} == hashes  # A's (oldest) pages stayed
    assert tier.pool.num_cached == 7 and tier.pinned == pinned
    m.fetch([b])  # cannot fail: the loads run
    assert not tier.pinned and not m.replicas[0].pending_loads("B")
    metrics = m.metrics
    assert metrics.cache_tokens == metrics.host_cache_tokens == 8
    assert metrics.device_cache_tokens == 0
    assert metrics.bytes_from_host == 2 * host_tier(m).pages.bytes_per_page
    c = TextContext(np.r_[np.arange(8), [6]], "C")  # now a device hit on the loaded pages
    m.external_claim("C")
    assert m.maybe_reserve(c) and c.start_idx == 8 and m.metrics.device_cache_tokens == 8


def test_false_from_maybe_reserve_changes_neither_tier(session):
    m = make_host(session)
    cached_on_host_only(m)
    hog = TextContext(np.arange(300, 317), "H")  # holds 5 of the 6 device pages
    m.external_claim("H")
    assert m.maybe_reserve(hog)
    b = TextContext(np.r_[np.arange(8), np.arange(50, 60)], "B")  # 2 host hits + 3 pages
    m.external_claim("B")
    tier = host_tier(m)
    before = (m.num_free_blocks, tier.pinned, tier.pool.indexed_hashes(), b.start_idx)
    assert not m.maybe_reserve(b)
    assert (m.num_free_blocks, tier.pinned, tier.pool.indexed_hashes(), b.start_idx) == before
    m.release("H")
    assert m.maybe_reserve(b) and b.start_idx == 8


def test_release_before_fetch_unpins(session):
    m = make_host(session)
    cached_on_host_only(m)
    b = TextContext(np.r_[np.arange(8), [5]], "B")
    m.external_claim("B")
    assert m.maybe_reserve(b) and host_tier(m).pinned
    m.release("B")
    assert not host_tier(m).pinned and m.num_free_blocks == 6
    m.check_invariants()


def test_runtime_checks_catch_a_host_page_with_other_tokens(session):
    m = make_host(session)
    cached_on_host_only(m)
    b = TextContext(np.r_[np.arange(8), [5]], "B")
    m.external_claim("B")
    assert m.maybe_reserve(b)
    tier = host_tier(m)
    page = min(tier.pinned)  # the host page of B's first load
    tier.pool._page_tokens[page] = b"other tokens"  # a bug hands the page to another prefix
    with pytest.raises(mokv.InvariantError, match="holds other tokens"):
        m.fetch([b])


def test_reset_clears_both_tiers_and_counters_report_the_tier(session):
    m = make_host(session, num_host_pages=10)
    assert (m.total_num_host_pages, m.host_committed_block_pct) == (10, 0.0)
    a = TextContext(np.arange(13), "A")
    m.external_claim("A")
    m.fetch([a])
    a.update(1)
    m.step([a])
    assert m.host_committed_block_pct == pytest.approx(0.3)
    assert m.metrics.bytes_to_host == 3 * host_tier(m).pages.bytes_per_page
    assert not m.reset_prefix_cache()  # A holds pages: refused, nothing forgotten
    assert m.host_committed_block_pct == pytest.approx(0.3)
    m.release("A")
    assert m.reset_prefix_cache()
    assert m.host_committed_block_pct == 0.0 and not host_tier(m).pool.indexed_hashes()
    assert m.num_free_blocks == 6


def test_two_replicas_have_their_own_host_tiers(session):
    m = make_host(session, num_host_pages=4, data_parallel_degree=2, n_devices=2)
    assert m.total_num_host_pages == 8
    assert [host_tier(m, r).pool.num_pages for r in range(2)] == [4, 4]


def test_min_hits_writes_a_page_through_only_once_it_was_hit(session):
    m = make_host(session, min_hits=2)
    host = host_tier(m).pool

    def turn(rid, tokens):
        ctx = TextContext(np.array(tokens), rid)
        m.external_claim(rid)
        m.fetch([ctx])
        ctx.update(1)
        m.step([ctx])
        m.release(rid)
        return ctx

    turn("A", np.arange(9))  # commits 2 pages: not stored yet
    assert host.num_cached == 0
    turn("B", np.r_[np.arange(8), [7]])  # first hit of both
    assert host.num_cached == 0
    turn("C", np.r_[np.arange(8), [8]])  # second hit: both written through at C's step
    assert host.num_cached == 2
    assert m.metrics.bytes_to_host == 2 * host_tier(m).pages.bytes_per_page
    evict_from_device(m)
    d = TextContext(np.r_[np.arange(8), [9]], "D")
    m.external_claim("D")
    assert m.maybe_reserve(d) and m.metrics.host_cache_tokens == 8
    with pytest.raises(ValueError, match="min_hits must be an int >= 0, got -1"):
        mokv.HostTierConfig(swap_space_gb=1, min_hits=-1)


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16])
@pytest.mark.parametrize("cache", ["heads", "mla"])
def test_manager_round_trip_on_two_tp_shards(session, dtype, cache):
    """Pages written on both shards (each device's heads, or each device's copy of an
    MLA latent) come back bit-exact into other device pages."""
    m = make_host(session, n_devices=2, dtype=dtype, **(mla() if cache == "mla" else {}))
    shards = [page_copy.numpy_view(b) for b in m.replicas[0].blocks]  # aliasing views
    a = TextContext(np.arange(9), "A")
    m.external_claim("A")
    m.fetch([a])
    pages = m.get_req_blocks("A")[:2]
    rng = np.random.default_rng(1)
    for view in shards:
        view[pages] = rng.integers(0, 2**15, view[pages].shape, dtype=view.dtype)
    original = [view[pages].copy() for view in shards]
    a.update(1)
    m.step([a])
    m.release("A")
    evict_from_device(m)
    for view in shards:
        view[:] = 0  # whatever the device held is gone
    b = TextContext(np.r_[np.arange(8), [5]], "B")
    m.external_claim("B")
    m.fetch([b])
    loaded = m.get_req_blocks("B")[:2]
    assert m.metrics.host_cache_tokens == 8
    for view, before in zip(shards, original):
        np.testing.assert_array_equal(view[loaded], before)


def test_metrics_count_hits_by_source_and_host_pages_evicted_unused(session):
    m = make_host(session, num_host_pages=10)
    cached_on_host_only(m)  # host: A's 2 pages, then X's 5
    b = TextContext(np.r_[np.arange(8), [5]], "B")
    m.external_claim("B")
    m.fetch([b])  # loads A's 2 pages back: reused
    b.update(1)
    m.step([b])
    m.release("B")
    c = TextContext(np.r_[np.arange(8), [6]], "C")  # on the device now
    m.external_claim("C")
    m.fetch([c])
    m.release("C")
    metrics = m.metrics
    assert metrics.cache_tokens_by_source == {"device": 8, "host": 8}
    assert sum(metrics.cache_tokens_by_source.values()) == metrics.cache_tokens == 16
    assert metrics.host_evicted_unused_pages == 0
    # Y's 5 pages need 5 host pages: 3 free, then the oldest leaves, X's last 2 (C's
    # device hits refreshed A's copies, the loaded ones)
    evict_from_device(m, range(200, 221), "Y")
    assert m.metrics.tiers["host"].evicted_unused_pages == 2
    evict_from_device(m, range(300, 321), "Z")  # X's other 3, then A's 2 (loaded: not counted)
    assert m.metrics.tiers["host"].evicted_unused_pages == 5
    a_pages = set(page_hashes(np.arange(8), 4, root_hash("xxh3", 0), page_hash_fn("xxh3")))
    assert not a_pages & host_tier(m).pool.indexed_hashes()  # A's copies went too
    m.reset_metrics()
    assert m.metrics.host_evicted_unused_pages == 0
