"""The shared (Redis) tier in the paged manager, on a real redis-server: manager B loads
the pages manager A committed, bit for bit; salts, TP shards and corrupt values never
give a wrong page; a False from maybe_reserve changes nothing; an exception anywhere
leaves the old state or the new one; a dead server is a miss."""

import itertools
import os
import time

import mokv
import numpy as np
import pytest
from mokv import TextContext
from mokv.cache import page_copy
from mokv.cache.page_pool import PagePool
from mokv.events.publisher import EventPublisher, EventRecorder, MediumSink, build_events
from mokv.managers.paged.replica import PagedReplica
from mokv.remote import RemotePageStore
from mokv.tiers.remote import RemoteTier
from mokv.tiers.stack import TierStack

from ..managers.conftest import make_paged, mla, small_params
from ..managers.faults import MODES, Faults, Injected, keep_handed_over, snapshot
from ..remote.conftest import forged_value

_namespaces = itertools.count()
PREFIX = np.arange(8)  # two full pages of 4 tokens


def remote_manager(session, server, namespace, num_pages=6, **overrides):
    return make_paged(session, num_pages=num_pages, max_seq_len=24,
                      tiers=(mokv.RemoteTierConfig(url=server.url, namespace=namespace),),
                      **overrides)


def stores(m, replica=0) -> list[RemotePageStore]:
    return m.replicas[replica].tiers.named("remote").stores


def fresh_namespace() -> str:
    return f"manager-{os.getpid()}-{next(_namespaces)}"


def serve(m, ctx, fill_seed=None):
    """Claims, fetches and steps `ctx` once (committing its full pages); with `fill_seed`
    the request's fresh pages get random bytes first, standing in for the model's keys
    and values. Returns the request's pages' bytes per device shard."""
    m.external_claim(ctx.request_id)
    m.fetch([ctx])
    r = m.replicas[m.get_replica(ctx)]
    pages = m.get_req_blocks(ctx.request_id)
    if fill_seed is not None:
        rng = np.random.default_rng(fill_seed)
        for block in r.blocks:
            view = page_copy.numpy_view(block)
            for page in pages[ctx.start_idx // m.page_size:]:
                view[page] = rng.integers(0, 2**32, view[page].shape, dtype=view.dtype)
    ctx.update(1)
    m.step([ctx])
    return [page_copy.numpy_view(block)[pages].copy() for block in r.blocks]


def reserved(m, tokens, request_id, cache_salt=None) -> TextContext:
    """A new request of `tokens` in `m`, claimed and reserved (maybe_reserve True)."""
    ctx = TextContext(tokens, request_id, cache_salt=cache_salt)
    m.external_claim(request_id)
    assert m.maybe_reserve(ctx)
    return ctx


def flush(m) -> None:
    for r in range(m.num_replicas):
        for store in stores(m, r):
            assert store.flush(10)


def committed_by_a(session, server, namespace, salt=None, **overrides):
    """Manager A serves PREFIX + [9] (two full pages, committed and queued to Redis)."""
    a = remote_manager(session, server, namespace, **overrides)
    data = serve(a, TextContext(np.r_[PREFIX, [9]], "A", cache_salt=salt), fill_seed=1)
    flush(a)
    return a, data


def test_b_loads_the_pages_a_committed_bit_exact_and_indexes_them(session, redis_server):
    ns = fresh_namespace()
    a, a_pages = committed_by_a(session, redis_server, ns)
    assert a.remote_metrics.pages_written == 2
    # Queued writes are bounded by bytes: a value is 64 + 4 * 8 + 32 (the keys digest) +
    # 1024 page bytes here.
    assert stores(a)[0].max_queued_pages == 256 * 2**20 // (64 + 32 + 32 + 1024)
    b = remote_manager(session, redis_server, ns)
    recorder = EventRecorder()
    b.replicas[0].pool.events = recorder
    ctx = reserved(b, np.r_[PREFIX, [5, 6]], "B")
    assert ctx.start_idx == 8
    pending = b.replicas[0].pending_loads("B")  # until fetch
    assert [name for name, _, _ in pending] == ["remote", "remote"]
    b.fetch([ctx])
    assert not b.replicas[0].pending_loads("B")
    pages = b.get_req_blocks("B")
    loaded = page_copy.numpy_view(b.replicas[0].blocks[0])[pages[:2]]
    np.testing.assert_array_equal(loaded, a_pages[0][:2])
    metrics = b.metrics
    assert metrics.cache_tokens == metrics.remote_cache_tokens == 8
    assert metrics.device_cache_tokens == metrics.host_cache_tokens == 0
    page_bytes = a_pages[0][0].nbytes
    assert metrics.bytes_from_remote == 2 * page_bytes
    remote = b.remote_metrics
    assert (remote.hits, remote.misses, remote.errors) == (2, 0, 0)
    # The loaded pages are device pages now: published, and hits for the next request.
    events = build_events(recorder.take(), 4, "GPU")
    assert [type(e).__name__ for e in events] == ["BlockStored"]
    assert events[0].block_hashes == [h for _, _, h in pending]
    assert b.replicas[0].committed_hashes("B") == [h for _, _, h in pending]
    assert events[0].parent_block_hash is None
    c = reserved(b, np.r_[PREFIX, [7]], "C")
    assert c.start_idx == 8
    assert b.metrics.device_cache_tokens == 8 and b.remote_metrics.lookups == 1
    b.check_invariants()
    a.close()
    b.close()


def test_pages_queued_to_the_store_are_announced_as_external(session, redis_server):
    # The shared tier's copies are published with medium "EXTERNAL" (Dynamo's External
    # tier), after the device's own store, and only those every shard queued.
    a = remote_manager(session, redis_server, fresh_namespace())
    recorder = EventRecorder()
    a.replicas[0].publish_to(recorder)
    serve(a, TextContext(np.r_[PREFIX, [9]], "A", cache_salt="t"))
    events = build_events(recorder.take(), 4)
    assert [(e.medium, e.block_hashes) for e in events] == [
        ("GPU", a.replicas[0].committed_hashes("A")),
        ("EXTERNAL", a.replicas[0].committed_hashes("A"))]
    assert all(e.parent_block_hash is None and e.extra_keys == [("t",), None] for e in events)
    for store in stores(a):  # a full queue drops the page: nothing announced
        store._max_queued = 0
    serve(a, TextContext(np.r_[PREFIX, [9, 10, 11, 12, 13]], "A2", cache_salt="t"))
    assert [e.medium for e in build_events(recorder.take(), 4)] == ["GPU"]
    a.close()


def test_the_remote_chain_continues_after_device_hits(session, redis_server):
    """B holds page 0 on its device; the store supplies page 1."""
    ns = fresh_namespace()
    a, a_pages = committed_by_a(session, redis_server, ns)
    b = remote_manager(session, redis_server, ns)
    b_pages = serve(b, TextContext(np.r_[PREFIX[:4], [1]], "X"), fill_seed=2)  # page 0
    assert b.metrics.remote_cache_tokens == 4  # X's page 0 came from the store already
    np.testing.assert_array_equal(b_pages[0][0], a_pages[0][0])
    b.release("X")
    ctx = reserved(b, np.r_[PREFIX, [5]], "B")
    assert ctx.start_idx == 8
    b.fetch([ctx])
    assert b.metrics.remote_cache_tokens == 8 and b.metrics.device_cache_tokens == 4
    loaded = page_copy.numpy_view(b.replicas[0].blocks[0])[b.get_req_blocks("B")[1]]
    np.testing.assert_array_equal(loaded, a_pages[0][1])
    a.close()
    b.close()


def test_different_cache_salts_never_share(session, redis_server):
    ns = fresh_namespace()
    a, _ = committed_by_a(session, redis_server, ns, salt="tenant-a")
    b = remote_manager(session, redis_server, ns)
    for rid, salt in (("none", None), ("other", "tenant-b")):
        ctx = reserved(b, np.r_[PREFIX, [5]], rid, cache_salt=salt)
        assert ctx.start_idx == 0
        b.release(rid)
    assert reserved(b, np.r_[PREFIX, [5]], "same", cache_salt="tenant-a").start_idx == 8
    a.close()
    b.close()


def test_tensor_parallel_counts_a_page_only_if_every_shard_holds_it(session, redis_server):
    ns = fresh_namespace()
    tp2 = dict(n_devices=2)  # one KV head per device
    a, a_pages = committed_by_a(session, redis_server, ns, **tp2)
    shards = stores(a)
    assert [s.layout.tp_rank for s in shards] == [0, 1]
    assert shards[0].key(1) != shards[1].key(1)
    # Shard 1 loses page 1 (as LRU eviction would): only page 0 is a hit.
    page_1 = a.replicas[0].committed_hashes("A")[1]
    redis_server.client().delete(shards[1].key(page_1))
    b = remote_manager(session, redis_server, ns, **tp2)
    ctx = reserved(b, np.r_[PREFIX, [5]], "B")
    assert ctx.start_idx == 4
    b.fetch([ctx])
    page = b.get_req_blocks("B")[0]
    for shard, block in enumerate(b.replicas[0].blocks):
        np.testing.assert_array_equal(page_copy.numpy_view(block)[page], a_pages[shard][0])
    assert b.metrics.remote_cache_tokens == 4
    # A TP=1 manager never reads the TP=2 shards (another layout, another key).
    c = remote_manager(session, redis_server, ns)
    ctx = reserved(c, np.r_[PREFIX, [5]], "C")
    assert ctx.start_idx == 0
    for m in (a, b, c):
        m.close()


def test_a_corrupted_value_is_a_counted_miss(session, redis_server):
    ns = fresh_namespace()
    a, _ = committed_by_a(session, redis_server, ns)
    key = stores(a)[0].key(a.replicas[0].committed_hashes("A")[1])
    client = redis_server.client()
    value = bytearray(client.get(key))
    value[-1] ^= 0x01  # one bit of the page's last byte
    client.set(key, bytes(value))
    b = remote_manager(session, redis_server, ns)
    ctx = reserved(b, np.r_[PREFIX, [5]], "B")
    assert ctx.start_idx == 4  # page 0 only
    remote = b.remote_metrics
    assert (remote.hits, remote.misses, remote.rejected_corrupt) == (1, 1, 1)
    a.close()
    b.close()


def b_with_a_hog(session, server, hog_tokens: int):
    """A committed the prefix; B holds a request H of `hog_tokens` tokens."""
    ns = fresh_namespace()
    a, _ = committed_by_a(session, server, ns)
    b = remote_manager(session, server, ns)
    return a, b, reserved(b, np.arange(300, 300 + hog_tokens), "H")


def test_false_from_maybe_reserve_changes_nothing_and_does_not_ask_redis(session,
                                                                         redis_server):
    a, b, hog = b_with_a_hog(session, redis_server, 17)  # 5 of the 6 device pages
    ctx = TextContext(np.r_[PREFIX, np.arange(50, 60)], "B")  # 2 remote hits + 3 pages
    b.external_claim("B")
    before = snapshot(b, [hog, ctx]), b.metrics, b.remote_metrics.lookups  # H's: a miss
    assert not b.maybe_reserve(ctx)
    # It could not fit: nothing changed, and no bytes were fetched in vain.
    assert (snapshot(b, [hog, ctx]), b.metrics, b.remote_metrics.lookups) == before
    b.release("H")
    assert b.maybe_reserve(ctx) and ctx.start_idx == 8
    b.fetch([ctx])
    assert b.metrics.remote_cache_tokens == 8
    a.close()
    b.close()


def test_a_batch_that_does_not_fit_changes_nothing_with_remote_hits_planned(session,
                                                                            redis_server):
    a, b, hog = b_with_a_hog(session, redis_server, 10)  # 3 of the 6 device pages
    # Each fits alone (2 remote hits + 1 fresh page), not both.
    batch = [TextContext(np.r_[PREFIX, [5, 6, 7]], "B"), TextContext(np.r_[PREFIX, [8]], "C")]
    for ctx in batch:
        b.external_claim(ctx.request_id)
    before = snapshot(b, [hog, *batch]), b.metrics
    with pytest.raises(mokv.InsufficientPagesError):
        b.fetch([hog, *batch])
    assert (snapshot(b, [hog, *batch]), b.metrics) == before
    assert b.remote_metrics.hits == 4  # both planned their two remote hits
    b.release("H")
    b.fetch(batch)  # both load the same two pages: one copy each is indexed
    assert [c.start_idx for c in batch] == [8, 8] and b.metrics.remote_cache_tokens == 16
    b.check_invariants()
    a.close()
    b.close()


FAULT_TARGETS = [
    (RemotePageStore, "lookup"),
    (RemotePageStore, "put"),
    (RemoteTier, "lookup"),
    (RemoteTier, "load"),
    (RemoteTier, "store"),
    (TierStack, "load"),
    (TierStack, "store"),
    (TierStack, "pin"),
    (TierStack, "unpin"),
    (TierStack, "count_served"),
    (TierStack, "note_reserved"),
    (PagedReplica, "plan"),
    (PagedReplica, "apply"),
    (PagedReplica, "fits"),
    (PagedReplica, "load_pending"),
    (PagedReplica, "commit"),
    (PagedReplica, "plan_commit"),
    (page_copy, "write_pages"),
    (page_copy, "read_pages"),
    (PagePool, "room"),
    (PagePool, "take"),
    (PagePool, "commit_pages"),
    (PagePool, "lookup"),
    (TextContext, "skip_cached_prefix"),
    (TextContext, "active_idx_after_skip"),
    (PagedReplica, "runtime_inputs"),
    (EventRecorder, "stored"),
    (MediumSink, "stored"),
    (EventPublisher, "end_step"),
]


FAULT_ENDPOINTS = itertools.count()
"""One counter for every case: a publisher of an earlier case that the garbage collector
has not closed yet still holds its inproc address."""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["maybe_reserve", "fetch", "step"])
def test_an_exception_anywhere_leaves_old_or_new_state(session, redis_server, monkeypatch, op,
                                                       mode):
    """B, publishing events, reserves two remote hits (maybe_reserve), loads them (fetch)
    and commits a page it computed, queued to the store (step); a fault instead of, and
    right after, every inner call in turn leaves the state before the call (and the
    call, retried, succeeds) or after it."""
    keep_handed_over(monkeypatch)

    def world():
        """A fresh namespace each time: B's step stores a page there."""
        ns = fresh_namespace()
        a, _ = committed_by_a(session, redis_server, ns)
        a.close()
        events = mokv.KVEventsConfig(endpoint=f"inproc://remote-faults-{next(FAULT_ENDPOINTS)}")
        b = remote_manager(session, redis_server, ns, kv_events=events)
        ctx = TextContext(np.r_[PREFIX, [5, 6, 7, 8, 9]], "B")
        b.external_claim("B")
        if op != "maybe_reserve":
            assert b.maybe_reserve(ctx)
        if op == "step":
            b.fetch([ctx])
            ctx.update(1)
        return b, ctx

    def call(b, ctx):
        if op == "step":
            return b.step([ctx])
        return b.maybe_reserve(ctx) if op == "maybe_reserve" else b.fetch([ctx])

    clean, ctx = world()
    call(clean, ctx)
    new_state = snapshot(clean, [ctx])
    clean.close()
    faults = Faults(monkeypatch, FAULT_TARGETS)
    num_faults = 0
    for fault_at in range(1, 100):
        faults.disarm()
        b, ctx = world()
        old_state = snapshot(b, [ctx])
        faults.arm(fault_at, mode)
        try:
            call(b, ctx)
        except Injected:
            num_faults += 1
            faults.disarm()
            state = snapshot(b, [ctx])
            assert state in (old_state, new_state), f"fault {mode} call {fault_at}"
            b.check_invariants()
            call(b, ctx)  # the retry succeeds
            assert snapshot(b, [ctx]) == new_state, f"fault {mode} call {fault_at}"
            b.release("B")
            assert b.num_free_blocks == 6
        else:
            num_calls = faults.calls
            faults.disarm()
            assert snapshot(b, [ctx]) == new_state
            b.close()
            break
        b.close()
    assert num_faults == num_calls > 3


def test_a_dead_server_is_a_miss_and_a_restarted_one_serves_again(session, own_redis_server):
    ns = fresh_namespace()
    a, _ = committed_by_a(session, own_redis_server, ns)
    own_redis_server.kill()
    b = remote_manager(session, own_redis_server, ns)
    for store in stores(b):
        store.breaker.cooldown_s = 0.2  # the test waits for the trial, not 5 s
    ctx = TextContext(np.r_[PREFIX, [5]], "B")
    serve(b, ctx)  # commits (queued puts fail: counted)
    assert ctx.start_idx == 9 and b.metrics.cache_tokens == 0
    flush(b)
    assert b.remote_metrics.errors >= 1
    b.release("B")
    # Back, empty: A's pages are gone, but B's writes and reads work again.
    own_redis_server.start()
    b.reset_prefix_cache()
    deadline = time.monotonic() + 10
    while stores(b)[0].breaker.state == "open" and time.monotonic() < deadline:
        time.sleep(0.05)
    ctx = TextContext(np.r_[PREFIX, [6]], "B2")
    serve(b, ctx)
    flush(b)
    c = remote_manager(session, own_redis_server, ns)
    ctx = reserved(c, np.r_[PREFIX, [7]], "C")
    assert ctx.start_idx == 8
    for m in (a, b, c):
        m.close()


def test_remote_tier_config_is_validated():
    with pytest.raises(ValueError, match="url='http://x': not a redis/rediss/unix:// URL"):
        mokv.RemoteTierConfig(url="http://x", namespace="m")
    with pytest.raises(ValueError, match="namespace must be 1-200 characters.*got None"):
        mokv.RemoteTierConfig(url="redis://127.0.0.1:1/0", namespace=None)
    with pytest.raises(ValueError, match="namespace.*'a:b'"):
        mokv.RemoteTierConfig(url="redis://h/0", namespace="a:b")
    with pytest.raises(ValueError, match=r"timeout_s must be a number of seconds in \(0, 60\], got 0"):
        mokv.RemoteTierConfig(url="redis://h/0", namespace="m", timeout_s=0)
    tier = mokv.RemoteTierConfig(url="redis://h/0", namespace="m")
    dtype = mokv.config.base.CACHE_DTYPES[0]
    with pytest.raises(ValueError, match="RemoteTierConfig needs enable_prefix_caching"):
        mokv.KVCacheParams(dtype, 2, 8, tiers=(tier,))
    with pytest.raises(ValueError, match="stable prefix_hash.*'builtin'"):
        mokv.KVCacheParams(dtype, 2, 8, enable_prefix_caching=True, prefix_hash="builtin",
                           tiers=(tier,))


def test_one_plan_walks_the_host_then_the_shared_tier_and_asks_the_pool_once(
        session, redis_server, monkeypatch):
    """B computed page 0 (written through to its host tier and the store), A then page 1
    (to the store), and B's device forgot both: one `maybe_reserve` plans page 0 from the
    host tier and page 1 from the store, asking the pool once how much room it has
    (`take` checks its own hits without asking again)."""
    ns = fresh_namespace()
    page_bytes = small_params().bytes_per_page(2)
    host = mokv.HostTierConfig(swap_space_gb=10 * page_bytes / 2**30)
    b = make_paged(session, num_pages=6, max_seq_len=24, tiers=(
        host, mokv.RemoteTierConfig(url=redis_server.url, namespace=ns)))
    serve(b, TextContext(np.r_[PREFIX[:4], [1]], "X"))
    b.release("X")
    flush(b)
    a, _ = committed_by_a(session, redis_server, ns)  # finds page 0, computes page 1
    serve(b, TextContext(np.arange(100, 121), "Y"))  # 6 pages: the device forgets the prefix
    b.release("Y")
    b.reset_metrics()
    calls = {"room": 0, "take": 0, "fits": 0}

    def counted(owner, name):
        real = getattr(owner, name)

        def count(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, count)

    counted(PagePool, "room")
    counted(PagePool, "take")
    counted(PagedReplica, "fits")
    ctx = reserved(b, np.r_[PREFIX, [5]], "B")
    assert ctx.start_idx == 8
    assert [name for name, _, _ in b.replicas[0].pending_loads("B")] == ["host", "remote"]
    assert calls == {"room": 1, "take": 1, "fits": 0}
    b.fetch([ctx])
    assert (b.metrics.host_cache_tokens, b.metrics.remote_cache_tokens) == (4, 4)
    b.check_invariants()
    a.close()
    b.close()


@pytest.mark.parametrize("mac_key", [None, b"a secret the servers share"], ids=["plain", "mac"])
def test_a_planted_page_is_served_only_without_a_mac_key(session, redis_server, mac_key):
    """A commits the prefix; a writer with Redis access replaces page 0 with poison that
    passes every check it can compute. Without a MAC key B serves the poison (the limit
    docs/tiers.md states); with one, B refuses it and computes the prefix itself."""
    ns = fresh_namespace()
    tiers = (mokv.RemoteTierConfig(url=redis_server.url, namespace=ns, mac_key=mac_key),)
    a = make_paged(session, num_pages=6, max_seq_len=24, tiers=tiers)
    serve(a, TextContext(np.r_[PREFIX, [9]], "A"), fill_seed=1)
    flush(a)
    store = stores(a)[0]
    page_hash = a.replicas[0].committed_hashes("A")[0]
    poison = np.full(store.layout.page_shape, 7.0, dtype=np.float32)
    redis_server.client().set(store.key(page_hash), forged_value(
        store.codec, page_hash, PREFIX[:4].astype("<i8").tobytes(), poison))
    b = make_paged(session, num_pages=6, max_seq_len=24, tiers=tiers)
    ctx = reserved(b, np.r_[PREFIX, [5]], "B")
    if mac_key is None:
        assert ctx.start_idx == 8
        b.fetch([ctx])
        loaded = page_copy.numpy_view(b.replicas[0].blocks[0])[b.get_req_blocks("B")[0]]
        assert loaded.tobytes() == poison.tobytes()  # the poison, served
    else:
        assert ctx.start_idx == 0 and b.remote_metrics.rejected_mac == 1
    a.close()
    b.close()


def test_mla_latents_round_trip_through_the_shared_tier_on_two_devices(session, redis_server):
    """An MLA cache's pages (one latent per token, whole on each device) go to Redis
    from each device and come back bit-exact into another manager's pages."""
    ns = fresh_namespace()
    a, a_pages = committed_by_a(session, redis_server, ns, **mla(n_devices=2))
    assert a.remote_metrics.pages_written == 2 * 2  # two pages, one value per device
    b = remote_manager(session, redis_server, ns, **mla(n_devices=2))
    ctx = reserved(b, np.r_[PREFIX, [5, 6]], "B")
    assert ctx.start_idx == 8
    b.fetch([ctx])
    pages = b.get_req_blocks("B")[:2]
    for block, before in zip(b.replicas[0].blocks, a_pages):
        np.testing.assert_array_equal(page_copy.numpy_view(block)[pages], before[:2])
    a.close()
    b.close()
