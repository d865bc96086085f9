"""The router index by tier: each source's pages weighed by where they are (device 1.0,
host 0.75, shared 0.25 by default, Dynamo's weights), so that a router prefers the replica
that holds a prefix on its device; and end to end, a manager's host tier over ZMQ."""

import time

import mokv
import numpy as np
import pytest
from mokv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSubscriber,
    KVEventBatch,
    KVEventsConfig,
    PrefixRouterIndex,
)

from tests.managers.conftest import NUM_LAYERS, small_params

from .conftest import inproc_name, make_publishing
from .test_publisher import hashes, run_request

TOKENS = np.arange(17)  # four full pages
H = hashes(range(16))


def stored(hs, medium, parent=None):
    return BlockStored(hs, parent, [0] * 4 * len(hs), 4, None, medium, None)


def batch(*events):
    return KVEventBatch(0.0, list(events), 0)


def test_each_page_weighs_what_its_best_tier_is_worth():
    index = PrefixRouterIndex(page_size=4)
    index.apply(("device", 0), batch(stored(H, "GPU")))
    index.apply(("host", 0), batch(stored(H, "CPU")))
    index.apply(("shared", 0), batch(stored(H, "EXTERNAL")))
    # two pages on the device, the next two only in host memory; a page in both is a
    # device page
    index.apply(("mixed", 0), batch(stored(H[:2], "GPU"), stored(H, "CPU")))
    assert index.match(TOKENS) == {("device", 0): 4, ("host", 0): 4, ("shared", 0): 4,
                                   ("mixed", 0): 4}
    assert index.scores(TOKENS) == {("device", 0): 4.0, ("host", 0): 3.0, ("shared", 0): 1.0,
                                    ("mixed", 0): 2 + 2 * 0.75}
    assert index.best(TOKENS) == (("device", 0), 4.0)
    assert index.match(TOKENS, tiers=("device",)) == {("device", 0): 4, ("host", 0): 0,
                                                       ("shared", 0): 0, ("mixed", 0): 2}
    assert index.match(TOKENS, tiers=("device", "host"))[("shared", 0)] == 0
    with pytest.raises(ValueError, match="tiers=\\('gpu',\\)"):
        index.match(TOKENS, tiers=("gpu",))
    assert index.hashes(("mixed", 0), "device") == set(H[:2])
    assert index.hashes(("mixed", 0)) == set(H)


def test_removal_and_clear_follow_the_medium():
    index = PrefixRouterIndex(page_size=4, host_weight=0.5, shared_weight=0.1)
    src = ("s", 0)
    index.apply(src, batch(stored(H, "GPU"), stored(H, "CPU"), stored(H, None)))
    assert index.scores(TOKENS)[src] == 4.0  # no medium: a device event (Dynamo, llm-d)
    index.apply(src, batch(BlockRemoved(H[2:], "GPU")))
    assert index.scores(TOKENS)[src] == 2 + 2 * 0.5  # evicted from the device, still on host
    index.apply(src, batch(BlockRemoved(H[1:2], "CPU")))
    assert index.scores(TOKENS)[src] == 2 + 2 * 0.5  # page 1 is still on the device
    index.apply(src, batch(stored(H, "EXTERNAL"), AllBlocksCleared()))
    assert index.scores(TOKENS)[src] == 0.0 and index.hashes(src) == set()


def test_other_media_and_page_sizes_are_ignored_and_counted():
    index = PrefixRouterIndex(page_size=4)
    index.apply(("s", 0), batch(stored(H, "STORAGE"), stored(H, "TAPE"),
                                BlockStored(H, None, [0] * 32, 8, None, "GPU", None)))
    assert index.num_ignored == 2  # an unknown medium, another page size
    assert index.hashes(("s", 0), "shared") == set(H)  # vLLM's "STORAGE": a lower tier
    assert index.scores(TOKENS) == {("s", 0): 1.0}


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(host_weight=1.5), "host_weight must be a number in \\[0, 1\\], got 1.5"),
    (dict(shared_weight=-0.1), "shared_weight must be a number in \\[0, 1\\], got -0.1"),
    (dict(host_weight="0.8"), "got '0.8'"),
    (dict(host_weight=0.2, shared_weight=0.3), "shared_weight=0.3 is above host_weight=0.2"),
])
def test_bad_weights_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrefixRouterIndex(page_size=4, **kwargs)
    with pytest.raises(ValueError, match="tier='disk'"):
        PrefixRouterIndex(page_size=4).hashes(("s", 0), "disk")


def test_router_prefers_the_replica_holding_the_prefix_on_its_device(session):
    # Two replicas with host tiers; both served the same prompt, then replica 0's device
    # pages were evicted (its copies stay in host memory). Over real ZMQ, the index
    # scores replica 1 (device) above replica 0 (host), which a count of pages cannot do.
    page_bytes = small_params().bytes_per_page(NUM_LAYERS)
    host = mokv.HostTierConfig(swap_space_gb=2 * 16 * page_bytes / 2**30)  # 16 per replica
    endpoint, replay = inproc_name(), inproc_name()
    m = make_publishing(session, KVEventsConfig(endpoint, replay_endpoint=replay), dp=2,
                        tiers=(host,))
    for replica in (0, 1):
        m.release(run_request(m, TOKENS[:9], replica).request_id)
    m.release(run_request(m, range(100, 116), 0).request_id)  # fills replica 0's device
    index = PrefixRouterIndex(page_size=4)
    subscriber = EventSubscriber(index)
    subscriber.add_source("srv", endpoint, replay_endpoint=replay)
    subscriber.add_source("srv", f"{endpoint}_dp1", replay_endpoint=f"{replay}_dp1")
    subscriber.sync()
    deadline = time.monotonic() + 10
    while [subscriber.last_seq(("srv", r)) for r in (0, 1)] != [
        p.last_seq for p in m.kv_event_publishers
    ]:
        assert time.monotonic() < deadline, "the event batches did not arrive"
        subscriber.poll(timeout_ms=10)
    prompt = TOKENS[:9]
    assert index.match(prompt) == {("srv", 0): 2, ("srv", 1): 2}
    assert index.scores(prompt) == {("srv", 0): 1.5, ("srv", 1): 2.0}
    assert index.best(prompt) == (("srv", 1), 2.0)
    for r in (0, 1):  # the consumer's tiers are the manager's
        assert index.hashes(("srv", r), "device") == m.replicas[r].pool.indexed_hashes()
        host_pool = m.replicas[r].tiers.named("host").pool
        assert index.hashes(("srv", r), "host") == host_pool.indexed_hashes()
    subscriber.close()
    m.close()


def test_the_router_prefers_a_replica_holding_a_live_pin():
    class Clock:
        now = 100.0

        def __call__(self):
            return self.now

    clock = Clock()
    index = PrefixRouterIndex(page_size=4, clock=clock)
    a, b = ("a", 0), ("b", 0)
    index.apply(a, batch(stored(H, "GPU")))  # a holds all four pages on its device
    index.apply(b, batch(stored(H[:2], "GPU"), stored(H, "CPU")))  # b: two, then host
    assert index.best(TOKENS) == (a, 4.0)
    index.note_pin(b, TOKENS, ttl_s=60)  # the router sent b a request pinning the prompt
    assert index.pinned_pages(index.page_hashes(TOKENS)) == {b: 4}
    assert index.best(TOKENS) == (b, 3.5)  # b keeps the prefix until its pin ends
    index.note_pin(a, TOKENS, ttl_s=30, num_tokens=9)  # two pages pinned on a
    assert index.pinned_pages(index.page_hashes(TOKENS)) == {a: 2, b: 4} and index.best(TOKENS)[0] == b
    clock.now = 159.999
    assert index.best(TOKENS)[0] == b
    clock.now = 160.0  # b's deadline exactly (a's ended at 130): events decide again
    assert index.pinned_pages(index.page_hashes(TOKENS)) == {} and index.best(TOKENS) == (a, 4.0)
    index.note_pin(b, TOKENS, ttl_s=5)
    index.apply(b, batch(AllBlocksCleared()))  # the server's reset ends its pins
    assert index.pinned_pages(index.page_hashes(TOKENS)) == {}
    with pytest.raises(ValueError, match="ttl_s"):
        index.note_pin(a, TOKENS, ttl_s=0)
