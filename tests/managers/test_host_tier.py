"""The host-memory page tier: bit-exact copies, leaf-LRU eviction, pins, the manager's
promises (False changes nothing in either tier; after True, fetch cannot fail), events
and metrics."""

import numpy as np
import pytest
from max.driver import CPU, Accelerator, Buffer, accelerator_count
from max.dtype import DType

import mokv
from mokv import TextContext
from mokv.cache import page_copy
from mokv.cache.host_pool import HostPagePool
from mokv.cache.page_copy import HostPages
from mokv.events.publisher import EventRecorder, build_events

from .conftest import NUM_LAYERS, make_paged, small_params


def host_options(num_host_pages: int, **overrides) -> dict:
    params = small_params(**overrides)
    gb = params.data_parallel_degree * num_host_pages * params.bytes_per_page(NUM_LAYERS) / 2**30
    return dict(overrides, enable_kvcache_swapping_to_host=True, host_kvcache_swap_space_gb=gb)


def make_host(session, num_pages=6, num_host_pages=10, **overrides):
    return make_paged(session, num_pages=num_pages, max_seq_len=24,
                      **host_options(num_host_pages, **overrides))


# --- copies ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16])
@pytest.mark.parametrize("path", ["numpy", "driver"])
def test_round_trip_is_bit_exact_with_split_heads(dtype, path, monkeypatch):
    """device -> host -> other device pages, two TP shards of one head each."""
    if path == "driver":  # the accelerator path, run on CPU buffers
        monkeypatch.setattr(page_copy, "_copy_host", lambda s, si, d, di: pytest.fail("numpy"))
        real = page_copy.copy_pages

        def driver_only(src, src_ids, dst, dst_ids, views=None):
            for s, t in zip(src, dst):
                page_copy._copy_driver(s, src_ids, t, dst_ids)
        monkeypatch.setattr(page_copy, "copy_pages", driver_only)
        assert real is not driver_only
    page_shape = [2, NUM_LAYERS, 4, 1, 8]  # [2, layers, page_size, heads per device, head_dim]
    shards = [Buffer(dtype, [8, *page_shape], device=CPU()) for _ in range(2)]
    rng = np.random.default_rng(0)
    original = []
    for shard in shards:
        bits = page_copy.numpy_view(shard)
        bits[:] = rng.integers(0, np.iinfo(bits.dtype).max, bits.shape, dtype=bits.dtype)
        original.append(bits.copy())
    host = HostPages(dtype, 5, page_shape, [CPU(), CPU()])
    host.offload(shards, [6, 1, 2], [4, 0, 1])  # runs [4] and [0, 1]
    for shard in shards:
        page_copy.numpy_view(shard)[:] = 0
    host.load([1, 4, 0], shards, [3, 5, 7])
    for shard, bits in zip(shards, original):
        back = page_copy.numpy_view(shard)
        np.testing.assert_array_equal(back[[3, 5, 7]], bits[[2, 6, 1]])
    assert host.bytes_to_host == host.bytes_from_host == 3 * host.bytes_per_page


@pytest.mark.skipif(accelerator_count() == 0, reason="needs a GPU (runs where MAX sees one)")
def test_accelerator_round_trip_through_pinned_host_pages():
    """On a GPU the host pages are pinned (`Usage.STAGING`) and the batched driver copies
    move pages bit-exact both ways."""
    gpu = Accelerator()
    page_shape = [2, NUM_LAYERS, 4, 1, 8]
    bits = np.random.default_rng(0).integers(0, 2**32, [6, *page_shape], dtype=np.uint32)
    device = Buffer.from_numpy(bits.view(np.float32)).to(gpu)
    host = HostPages(DType.float32, 4, page_shape, [gpu])
    assert host.buffers[0].pinned
    host.offload([device], [5, 0, 3], [1, 2, 0])
    host.load([2, 0, 1], [device], [1, 2, 4])
    back = device.to(CPU()).to_numpy().view(np.uint32)
    np.testing.assert_array_equal(back[[1, 2, 4]], bits[[0, 3, 5]])
    np.testing.assert_array_equal(back[[0, 3, 5]], bits[[0, 3, 5]])  # sources untouched


# --- the host pool --------------------------------------------------------------------


def stored(pool: HostPagePool, chain: list[int], parent=None) -> list[int]:
    plan = pool.plan_store(chain, ())
    pool.evict(plan.victims)
    tokens = [h.to_bytes(8, "little") for h in chain]  # one int64 token per page
    pool.insert(plan.targets, chain, tokens, [parent, *chain[:-1]])
    pool.check_invariants()
    return plan.targets


def test_eviction_is_lru_over_leaves():
    pool = HostPagePool(5)
    stored(pool, [1, 2, 3])  # chain 1 <- 2 <- 3
    stored(pool, [7, 8])
    pool.touch_hashes([1])  # the oldest page is now a young prefix, yet not a leaf
    plan = pool.plan_store([20, 21, 22, 23], ())
    # Leaves oldest first: 3, then its parent 2 (now a leaf), then 8, 7; never 1 before 2.
    assert [pool.page_hash(p) for p in plan.victims] == [3, 2, 8, 7]
    assert len(plan.entries) == 4


def test_pinned_pages_are_never_evicted_or_reused():
    pool = HostPagePool(3)
    a, b, c = stored(pool, [1, 2, 3])
    plan = pool.plan_store([9, 10, 11], protected={c})
    assert plan.entries == []  # the only leaf, 3, is pinned; its ancestors are no leaves
    pool.reset_prefix_cache()  # every page free, but the pinned one still not reusable
    plan = pool.plan_store([9, 10, 11], protected={c})
    assert sorted(plan.targets) == sorted([a, b]) and plan.entries == [0, 1]
    pool.check_invariants()


# --- the manager ----------------------------------------------------------------------


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
    pinned = dict(m.replicas[0]._pinned)
    assert len(pinned) == 2
    host = m.replicas[0].host
    hashes = {host.page_hash(p) for p in pinned}
    evict_from_device(m, range(200, 211), "Y")  # 2 more pages: the host tier evicts
    assert {host.page_hash(p) for p in pinned} == hashes  # A's (oldest) pages stayed
    assert host.num_cached == 7 and dict(m.replicas[0]._pinned) == pinned
    m.fetch([b])  # cannot fail: the loads run
    assert not m.replicas[0]._pinned
    metrics = m.metrics
    assert metrics.cache_tokens == metrics.host_cache_tokens == 8
    assert metrics.device_cache_tokens == 0
    assert metrics.bytes_from_host == 2 * m.replicas[0].host_pages.bytes_per_page
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
    r = m.replicas[0]
    before = (m.num_free_blocks, dict(r._pinned), r.host.indexed_hashes(), b.start_idx)
    assert not m.maybe_reserve(b)
    assert (m.num_free_blocks, dict(r._pinned), r.host.indexed_hashes(), b.start_idx) == before
    m.release("H")
    assert m.maybe_reserve(b) and b.start_idx == 8


def test_release_before_fetch_unpins(session):
    m = make_host(session)
    cached_on_host_only(m)
    b = TextContext(np.r_[np.arange(8), [5]], "B")
    m.external_claim("B")
    assert m.maybe_reserve(b) and m.replicas[0]._pinned
    m.release("B")
    assert not m.replicas[0]._pinned and m.num_free_blocks == 6
    m.check_invariants()


def test_runtime_checks_catch_a_host_page_with_other_tokens(session):
    m = make_host(session)
    cached_on_host_only(m)
    b = TextContext(np.r_[np.arange(8), [5]], "B")
    m.external_claim("B")
    assert m.maybe_reserve(b)
    host = m.replicas[0].host
    page = m.replicas[0]._requests["B"].loads[0].host_page
    host._page_tokens[page] = b"other tokens"  # a bug hands the page to another prefix
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
    assert m.metrics.bytes_to_host == 3 * m.replicas[0].host_pages.bytes_per_page
    m.reset_prefix_cache()
    assert m.host_committed_block_pct == 0.0 and not m.replicas[0].host.indexed_hashes()
    m.release("A")
    assert m.num_free_blocks == 6


def test_two_replicas_have_their_own_host_tiers(session):
    m = make_host(session, num_host_pages=4, data_parallel_degree=2, n_devices=2)
    assert m.total_num_host_pages == 8
    assert [r.host.num_pages for r in m.replicas] == [4, 4]


def test_host_events_carry_medium_cpu():
    recorder = EventRecorder()
    pool = HostPagePool(2)
    pool.events = recorder.medium_sink("CPU")
    recorder.stored(1, None, (5).to_bytes(8, "little"), None)  # the device tier's store
    stored(pool, [1])
    stored(pool, [2, 3])  # evicts 1
    events = build_events(recorder.take(), 1, "GPU")
    kinds = [(type(e).__name__, e.medium) for e in events]
    assert kinds == [("BlockStored", "GPU"), ("BlockStored", "CPU"), ("BlockRemoved", "CPU"),
                     ("BlockStored", "CPU")]
    assert events[3].block_hashes == [2, 3]


def test_min_hits_writes_a_page_through_only_once_it_was_hit(session):
    m = make_host(session, host_kvcache_min_hits=2)
    host = m.replicas[0].host

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
    assert m.metrics.bytes_to_host == 2 * m.replicas[0].host_pages.bytes_per_page
    evict_from_device(m)
    d = TextContext(np.r_[np.arange(8), [9]], "D")
    m.external_claim("D")
    assert m.maybe_reserve(d) and m.metrics.host_cache_tokens == 8
    with pytest.raises(ValueError, match="host_kvcache_min_hits"):
        small_params(**host_options(4, host_kvcache_min_hits=-1))


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16])
def test_manager_round_trip_on_two_tp_shards(session, dtype):
    """Pages written on both shards come back bit-exact into other device pages."""
    m = make_host(session, n_devices=2, dtype=dtype)
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


def test_a_store_never_evicts_the_pages_it_refreshes():
    pool = HostPagePool(2)
    stored(pool, [1])
    stored(pool, [5])  # 1 is the oldest leaf
    plan = pool.plan_store([1, 2], ())  # refreshes 1, stores 2: evicts 5, not 1
    assert plan.present == [pool.lookup(1, (1).to_bytes(8, "little"))]
    assert [pool.page_hash(p) for p in plan.victims] == [5]
