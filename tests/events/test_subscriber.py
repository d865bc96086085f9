"""The subscriber side: catching up through replay, detecting a restarted publisher and a
lost gap, the router index's leading-page answers, and salting."""

import time

import mokv
import numpy as np
import zmq
from mokv.events import EventPublisher, EventSubscriber, KVEventsConfig, PrefixRouterIndex

from .conftest import free_port, inproc_name, make_publishing
from .test_publisher import hashes
from .test_publisher import run_request as _run_request


def run_request(m, tokens, salt=None):
    """One request's prefill step, then its release (its pages stay cached)."""
    m.release(_run_request(m, tokens, salt=salt).request_id)


def wait(sub, source, seq, timeout=5.0):
    """Polls until the last batch applied for `source` is `seq`."""
    deadline = time.monotonic() + timeout
    while sub.last_seq(source) != seq and time.monotonic() < deadline:
        sub.poll(20)
    assert sub.last_seq(source) == seq


def test_late_subscriber_catches_up_through_replay(session):
    pub, replay = inproc_name(), inproc_name()
    m = make_publishing(session, KVEventsConfig(pub, replay_endpoint=replay), num_pages=8)
    run_request(m, range(9))
    run_request(m, range(30, 41))
    idx = PrefixRouterIndex(4)
    sub = EventSubscriber(idx)
    sub.add_source("s", pub, replay)
    sub.sync()  # no live batch needed: asks the replay socket from seq 0
    publisher = m.kv_event_publishers[0]
    assert sub.last_seq(("s", 0)) == publisher.last_seq == 2
    assert idx.hashes(("s", 0)) == m.replicas[0].pool.indexed_hashes()
    time.sleep(0.1)
    run_request(m, range(50, 59))  # and it follows live batches after that
    wait(sub, ("s", 0), 3)
    assert idx.hashes(("s", 0)) == m.replicas[0].pool.indexed_hashes()
    assert sub.num_restarts == sub.num_lost_gaps == 0
    sub.close()
    m.close()


def test_missed_live_batches_are_replayed(session):
    pub, replay = inproc_name(), inproc_name()
    m = make_publishing(session, KVEventsConfig(pub, replay_endpoint=replay), num_pages=8)
    idx = PrefixRouterIndex(4)
    sub = EventSubscriber(idx)
    sub.add_source("s", pub, replay)
    time.sleep(0.1)
    run_request(m, range(9))
    wait(sub, ("s", 0), 1)  # seq 0 came through replay on the first gap
    sub._streams[0].sub.setsockopt(zmq_unsubscribe(), b"")  # go deaf for two batches
    time.sleep(0.1)
    run_request(m, range(20, 29))
    run_request(m, range(40, 49))
    time.sleep(0.2)
    sub._streams[0].sub.setsockopt(zmq_subscribe(), b"")
    time.sleep(0.1)
    run_request(m, range(60, 69))
    wait(sub, ("s", 0), 4)
    assert sub.num_replayed >= 3
    assert idx.hashes(("s", 0)) == m.replicas[0].pool.indexed_hashes()
    sub.close()
    m.close()


def zmq_subscribe():
    import zmq

    return zmq.SUBSCRIBE


def zmq_unsubscribe():
    import zmq

    return zmq.UNSUBSCRIBE


def test_restarted_publisher_is_detected():
    """A new publisher process numbers its batches from 0 again: seq goes back. One PUB
    socket stands for both processes, so the test does not wait on a TCP reconnect."""
    import msgspec
    from mokv.events.format import AllBlocksCleared, BlockStored, KVEventBatch

    endpoint = inproc_name()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    idx = PrefixRouterIndex(4)
    sub = EventSubscriber(idx)
    sub.add_source("s", endpoint)
    time.sleep(0.1)

    def send(seq, *events):
        batch = KVEventBatch(time.time(), list(events), 0)
        pub.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)])

    def block(h):
        return BlockStored([h], None, [0] * 4, 4, None, "CPU", None)

    send(0, AllBlocksCleared())
    for seq, h in ((1, 1), (2, 2), (3, 3)):
        send(seq, block(h))
    wait(sub, ("s", 0), 3)
    assert idx.hashes(("s", 0)) == {1, 2, 3}
    send(0, AllBlocksCleared())  # the restarted process's startup batch
    send(1, block(9))
    wait(sub, ("s", 0), 1)
    assert sub.num_restarts == 1
    assert idx.hashes(("s", 0)) == {9}  # the old process's pages are gone
    send(5, block(10))  # a gap nobody can replay: the source's state is dropped
    wait(sub, ("s", 0), 5)
    assert sub.num_lost_gaps == 1 and idx.hashes(("s", 0)) == {10}
    sub.close()
    pub.close()


def test_index_counts_leading_pages_per_source():
    from mokv.events.format import BlockRemoved, BlockStored, KVEventBatch

    idx = PrefixRouterIndex(4)
    a = hashes(range(16))
    idx.apply(("x", 0), KVEventBatch(0.0, [BlockStored(a, None, list(range(16)), 4, None,
                                                       "GPU", None)]))
    idx.apply(("x", 1), KVEventBatch(0.0, [BlockStored(a[:2], None, list(range(8)), 4, None,
                                                       "GPU", None)]))
    idx.apply(("y", 0), KVEventBatch(0.0, [BlockStored(a[1:], a[0], list(range(4, 16)), 4,
                                                       None, "GPU", None)]))
    assert idx.match(np.arange(18)) == {("x", 0): 4, ("x", 1): 2, ("y", 0): 0}
    assert idx.best(np.arange(18)) == (("x", 0), 4)
    idx.apply(("x", 0), KVEventBatch(0.0, [BlockRemoved([a[2]], "GPU")]))
    assert idx.match(np.arange(18))[("x", 0)] == 2
    assert idx.match(np.arange(18), cache_salt="t") == {("x", 0): 0, ("x", 1): 0, ("y", 0): 0}


def test_salts_isolate_and_equal_salts_share(session):
    m = make_publishing(session, KVEventsConfig(inproc_name()), num_pages=16)

    def hit(salt):
        ctx = mokv.TextContext(np.arange(9), cache_salt=salt)
        m.claim(ctx.request_id)
        m.maybe_reserve(ctx)
        start = ctx.start_idx
        m.release(ctx.request_id)
        return start

    run_request(m, range(9), salt="a")
    assert hit("a") == 8  # same salt: both pages shared
    assert hit("b") == 0 and hit(None) == 0  # another salt, or none: nothing shared
    run_request(m, range(9), salt="b")
    assert hit("b") == 8
    m.close()


def test_restarted_publisher_process_is_detected_over_tcp():
    """The same with real publishers: the first closes, a second (a restarted process,
    seq from 0 again) binds the same port; the subscriber's socket reconnects by itself."""
    port = free_port()
    idx = PrefixRouterIndex(4)
    sub = EventSubscriber(idx)
    sub.add_source("s", f"tcp://127.0.0.1:{port}")
    first = EventPublisher(KVEventsConfig(f"tcp://*:{port}"), 0, 4, "CPU")
    time.sleep(0.3)
    for h in (1, 2, 3):
        first.stored(h, None, bytes(32), None)
        first.end_step()
    wait(sub, ("s", 0), 3)
    first.close()
    for _ in range(100):  # the old socket releases its port asynchronously
        try:
            second = EventPublisher(KVEventsConfig(f"tcp://*:{port}"), 0, 4, "CPU")
            break
        except zmq.ZMQError:
            time.sleep(0.05)
    for h in range(100, 150):  # until the reconnect is up (a PUB drops what nobody hears)
        second.stored(h, None, bytes(32), None)
        second.end_step()
        sub.poll(100)
        if sub.num_restarts:
            break
    assert sub.num_restarts == 1
    assert idx.hashes(("s", 0)) and not idx.hashes(("s", 0)) & {1, 2, 3}
    second.close()
    sub.close()
