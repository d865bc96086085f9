"""A dead, slow or restarted server: misses and counters, never an exception or a wait
longer than the timeouts; the breaker stops asking, then recovers."""

import time

from .conftest import chain, pages, put_all


def test_killed_server_gives_misses_then_the_breaker_stops_asking(own_redis_server, make_store):
    store = make_store(own_redis_server, timeout_s=0.5, failure_threshold=2, cooldown_s=1.0)
    links, datas = chain(4), pages(4)
    put_all(store, links, datas)
    assert len(store.lookup(links)) == 4
    own_redis_server.kill()
    assert store.lookup(links) == []  # refused: an error, then the breaker counts
    assert store.probe(links) == 0
    m = store.metrics
    assert m.errors == 2 and m.breaker_trips == 1 and store.breaker.state == "open"
    start = time.monotonic()
    for _ in range(100):  # open: nothing is sent
        assert store.lookup(links) == []
        assert store.put(*links[0], datas[0])
    assert store.flush(2)
    assert time.monotonic() - start < 1.0
    assert m.errors == 2 and m.skipped >= 101 and m.misses == 101

    # Restarted (empty: no persistence): still open until the cooldown ends...
    own_redis_server.start()
    assert store.lookup(links) == [] and m.errors == 2
    time.sleep(1.0)
    # ...then one trial closes it: pages written again are found again.
    assert store.lookup(links) == [] and store.breaker.state == "closed"
    put_all(store, links, datas)
    assert [bytes(p) for p in store.lookup(links)] == [d.tobytes() for d in datas]
    assert m.timeouts == 0


def test_failed_trial_reopens_for_a_whole_cooldown(own_redis_server, make_store):
    store = make_store(own_redis_server, timeout_s=0.5, failure_threshold=1, cooldown_s=0.5)
    links = chain(2)
    own_redis_server.kill()
    assert store.lookup(links) == [] and store.metrics.breaker_trips == 1
    time.sleep(0.5)
    assert store.lookup(links) == [] and store.metrics.breaker_trips == 2  # the trial failed
    assert store.lookup(links) == [] and store.metrics.errors == 2


def test_slow_server_times_out_and_a_full_queue_drops(own_redis_server, make_store):
    # A long timeout, so that all the puts below happen while the writer waits on its first.
    store = make_store(own_redis_server, timeout_s=1.0, failure_threshold=2, cooldown_s=30,
                       max_queued_pages=8, max_batch_pages=4)
    links, datas = chain(100), pages(100)
    put_all(store, links[:2], datas[:2])
    own_redis_server.pause()
    try:
        start = time.monotonic()
        assert store.lookup(links[:2]) == []  # waits for one timeout, no longer
        assert time.monotonic() - start < 1.0 * 2.5
        assert store.metrics.timeouts == 1
        slowest, accepted = 0.0, 0
        for link, data in zip(links[2:], datas[2:]):  # the writer is stuck in a timeout
            t = time.monotonic()
            accepted += store.put(*link, data)
            slowest = max(slowest, time.monotonic() - t)
        assert slowest < 0.1  # never waits for the writer
        m = store.metrics
        assert accepted <= 8 + 4 and m.drops == 98 - accepted and m.drops >= 86
        assert store.flush(5)  # the writer times out once more: the breaker opens
        assert m.breaker_trips == 1 and m.timeouts == 2 and m.skipped > 0
    finally:
        own_redis_server.resume()
    assert store.lookup(links[:2]) == []  # open for 30 s: not even asked
    assert store.metrics.errors == 0


def test_unreachable_url_is_only_misses(make_store, own_redis_server):
    own_redis_server.kill()  # a port where nothing listens
    store = make_store(own_redis_server, timeout_s=0.2)
    links = chain(3)
    assert store.lookup(links) == [] and store.probe(links) == 0
    put_all(store, links, pages(3))
    assert store.metrics.pages_written == 0 and store.metrics.errors == 3
