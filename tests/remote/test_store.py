"""RemotePageStore against a real redis-server: round trips, SET NX, chain probes, and
values that must never come back as pages (corrupted, another layout, other tokens,
copied from another namespace, planted without the MAC key)."""

import numpy as np
from max.dtype import DType
from mokv.remote import PageCodec, RemoteLayout

from .conftest import SMALL, chain, forged_value, pages, put_all


def test_round_trip_is_bit_exact(redis_server, make_store):
    store = make_store(redis_server)
    links, datas = chain(5), pages(5)
    put_all(store, links, datas)
    got = store.lookup(links)
    assert len(got) == 5
    for page, data in zip(got, datas):
        assert bytes(page) == data.tobytes()
        assert np.array_equal(np.frombuffer(page, np.float32).reshape(SMALL.page_shape), data)
    m = store.metrics
    assert (m.hits, m.misses, m.pages_written, m.errors, m.timeouts) == (5, 0, 5, 0, 0)
    assert m.bytes_written == m.bytes_read == 5 * store.codec.value_nbytes


def test_bfloat16_pages_round_trip_as_raw_bytes(redis_server, make_store):
    layout = RemoteLayout(DType.bfloat16, 4, 2, 2, 8)
    store = make_store(redis_server, layout)
    links = chain(2)
    raw = [np.random.default_rng(i).bytes(layout.page_nbytes) for i in range(2)]
    put_all(store, links, raw)
    assert [bytes(p) for p in store.lookup(links)] == raw


def test_writes_are_set_if_absent(redis_server, make_store):
    store = make_store(redis_server)
    links = chain(1)
    first, second = pages(2)
    put_all(store, links, [first])
    put_all(store, links, [second])
    (page,) = store.lookup(links)
    assert bytes(page) == first.tobytes()
    assert (store.metrics.pages_written, store.metrics.pages_present) == (1, 1)


def test_probe_counts_consecutive_hits(redis_server, make_store):
    store = make_store(redis_server)
    links, datas = chain(6), pages(6)
    put_all(store, [links[i] for i in (0, 1, 2, 4, 5)], [datas[i] for i in (0, 1, 2, 4, 5)])
    assert store.probe(links) == 3
    assert store.probe(links, max_pages=2) == 2
    assert store.probe(links[3:]) == 0
    assert store.probe([]) == 0
    assert len(store.lookup(links)) == 3
    assert len(store.lookup(iter(links), max_pages=1)) == 1
    assert store.lookup(links[3:]) == []
    m = store.metrics
    assert (m.lookups, m.hits, m.misses) == (3, 4, 2)


def test_namespaces_and_salts_do_not_share(redis_server, make_store):
    a = make_store(redis_server, namespace="model-a")
    b = make_store(redis_server, namespace="model-b")
    links = chain(2, salt="tenant-1")
    put_all(a, links, pages(2))
    assert a.probe(links) == 2 and b.probe(links) == 0
    assert a.probe(chain(2, salt="tenant-2")) == 0 and a.probe(chain(2)) == 0


def test_corrupted_value_is_a_miss(redis_server, make_store):
    store = make_store(redis_server)
    links, datas = chain(3), pages(3)
    put_all(store, links, datas)
    client = redis_server.client()
    client.setrange(store.key(links[1][0]), store.codec.value_nbytes - 1, b"\x99")  # last byte
    got = store.lookup(links)
    assert [bytes(p) for p in got] == [datas[0].tobytes()]
    assert store.metrics.rejected_corrupt == 1 and store.metrics.misses == 1
    client.set(store.key(links[0][0]), b"MKVP")  # truncated
    assert store.lookup(links) == [] and store.metrics.rejected_corrupt == 2
    assert store.metrics.errors == 0


def test_another_layouts_value_is_a_miss(redis_server, make_store):
    store = make_store(redis_server)
    other = RemoteLayout(DType.float16, 4, 2, 2, 16)  # the same number of bytes per page
    assert other.page_nbytes == SMALL.page_nbytes
    (page_hash, tokens), = links = chain(1)
    client = redis_server.client()
    other_codec = PageCodec(other, store.namespace)
    client.set(store.key(page_hash), other_codec.encode(page_hash, tokens, pages(1)[0].tobytes()))
    assert store.lookup(links) == [] and store.metrics.rejected_layout == 1
    # A store of the other layout never even sees this store's pages: another key.
    put_all(store, chain(2, seed=1), pages(2))
    assert make_store(redis_server, other, namespace=store.namespace).probe(chain(2, seed=1)) == 0


def test_other_tokens_under_the_same_hash_are_a_miss(redis_server, make_store):
    store = make_store(redis_server)
    (page_hash, _), = links = chain(1)
    (_, other_tokens), = chain(1, seed=7)
    client = redis_server.client()
    client.set(store.key(page_hash),
               store.codec.encode(page_hash, other_tokens, pages(1)[0].tobytes()))
    assert store.lookup(links) == [] and store.metrics.rejected_tokens == 1


def test_eviction_makes_misses_never_errors(small_redis_server, make_store):
    layout = RemoteLayout(DType.float32, 16, 4, 2, 64)  # 64 KiB pages; the server holds ~2 MB
    store = make_store(small_redis_server, layout, max_queued_pages=128)
    links = chain(96, page_size=16)
    rng = np.random.default_rng(0)
    datas = [rng.bytes(layout.page_nbytes) for _ in links]
    for start in range(0, 96, 32):  # 6 MB in all
        put_all(store, links[start:start + 32], datas[start:start + 32])
    assert small_redis_server.client().info("stats")["evicted_keys"] > 0
    assert store.probe(links) < 96 and len(store.lookup(links)) < 96
    # Page by page (LRU is sampled, so which pages survive varies): each is either
    # absent or exactly the page stored; some are still there.
    found = 0
    for link, data in zip(links, datas):
        got = store.lookup([link])
        assert got == [] or bytes(got[0]) == data
        found += len(got)
    assert 0 < found < 96
    m = store.metrics
    assert (m.errors, m.timeouts, m.drops, m.skipped) == (0, 0, 0, 0)
    assert m.rejected_corrupt == m.rejected_layout == m.rejected_tokens == m.rejected_keyspace == 0


def test_a_value_copied_under_another_namespace_is_a_miss(redis_server, make_store):
    """Issue 41: the header names the key space, so a value copied from one namespace's
    key to another's is refused (before, it was served)."""
    a, b = make_store(redis_server), make_store(redis_server)
    links = chain(1)
    put_all(a, links, pages(1))
    client = redis_server.client()
    client.set(b.key(links[0][0]), client.get(a.key(links[0][0])))
    assert b.probe(links) == 1  # the key is there
    assert b.lookup(links) == [] and b.metrics.rejected_keyspace == 1


KEY = b"a secret the servers share"


def test_stores_sharing_a_mac_key_share_pages(redis_server, make_store):
    writer = make_store(redis_server, mac_key=KEY)
    reader = make_store(redis_server, namespace=writer.namespace, mac_key=KEY)
    plain = make_store(redis_server, namespace=writer.namespace)
    links, datas = chain(3), pages(3)
    put_all(writer, links, datas)
    assert [bytes(p) for p in reader.lookup(links)] == [d.tobytes() for d in datas]
    assert plain.probe(links) == 0  # another key space: it never reads sealed values
    assert writer.metrics.bytes_written == 3 * writer.codec.value_nbytes


def test_with_a_mac_key_a_planted_page_is_a_miss(redis_server, make_store):
    """A writer with Redis access plants a page under the servers' key: right hash,
    tokens, layout, key space digest and checksum, but a tag made without the key."""
    plain, store = make_store(redis_server), make_store(redis_server, mac_key=KEY)
    (page_hash, tokens), = links = chain(1)
    for victim in (plain, store):
        value = forged_value(victim.codec, page_hash, tokens, pages(1)[0].tobytes())
        redis_server.client().set(victim.key(page_hash), value)
    assert len(plain.lookup(links)) == 1  # without a MAC key, a planted page is served
    assert store.lookup(links) == [] and store.metrics.rejected_mac == 1
