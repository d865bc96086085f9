"""Presence for routers: two servers share one Redis; the router follows both servers'
events and asks the shared tier which of a prompt's pages it holds, so a server that
never saw a prompt scores its shared pages (below the device's), an evicted page stops
counting at once, and a dead store counts nothing, without an error."""

import itertools
import time

import mokv
import numpy as np
import pytest
from mokv.events import (
    BlockStored,
    EventSubscriber,
    KVEventBatch,
    KVEventsConfig,
    PrefixRouterIndex,
)
from mokv.remote import RemoteLayout, RemotePageStore

from tests.managers.conftest import NUM_LAYERS, small_params

from ..remote.conftest import own_redis_server  # noqa: F401 (a fixture)
from .conftest import inproc_name, make_publishing
from .test_publisher import run_request

PROMPT = np.arange(13)  # three full pages


def test_the_router_scores_what_the_shared_tier_holds_for_every_server(
    session, own_redis_server  # noqa: F811 (the fixture)
):
    tier = mokv.RemoteTierConfig(url=own_redis_server.url, namespace="presence")
    servers = {}
    router = PrefixRouterIndex(page_size=4)  # the events alone
    presence = RemotePageStore(own_redis_server.url, "presence",
                               RemoteLayout.from_params(small_params(), NUM_LAYERS))
    index = PrefixRouterIndex(page_size=4, shared=presence)
    subscriber = EventSubscriber(index)
    events_only = EventSubscriber(router)
    try:
        for name in ("a", "b"):
            endpoint, replay = inproc_name(), inproc_name()
            servers[name] = make_publishing(session, KVEventsConfig(endpoint, replay_endpoint=replay),
                                            num_pages=8, tiers=(tier,))
            for sub in (subscriber, events_only):
                sub.add_source(name, endpoint, replay_endpoint=replay)
        a, b = servers["a"], servers["b"]
        assert a.replicas[0].tiers.named("remote").stores[0].layout == presence.layout
        a.release(run_request(a, PROMPT).request_id)  # A computes the prompt
        b.release(run_request(b, np.arange(100, 105)).request_id)  # B another one
        for m in (a, b):
            assert m.replicas[0].tiers.named("remote").stores[0].flush(10)
        for sub in (subscriber, events_only):
            sub.sync()
            deadline = time.monotonic() + 10
            while [sub.last_seq((n, 0)) for n in "ab"] != [
                servers[n].kv_event_publishers[0].last_seq for n in "ab"
            ]:
                assert time.monotonic() < deadline, "the event batches did not arrive"
                sub.poll(timeout_ms=10)

        # Events alone: B never stored the prompt, so it scores nothing.
        assert router.scores(PROMPT) == {("a", 0): 3.0, ("b", 0): 0.0}
        # With presence: B could load all three pages from the store, at 0.25 each.
        assert index.scores(PROMPT) == {("a", 0): 3.0, ("b", 0): 0.75}
        assert index.best(PROMPT) == (("a", 0), 3.0)
        assert index.match(PROMPT, tiers=("device",)) == {("a", 0): 3, ("b", 0): 0}
        assert presence.metrics.errors == 0

        # Redis evicts page 1: presence counts page 0 only; A's events still say 3.
        page_1 = index.page_hashes(PROMPT)[1]
        own_redis_server.client().delete(presence.key(page_1))
        assert index.scores(PROMPT) == {("a", 0): 3.0, ("b", 0): 0.25}
        assert index.match(PROMPT, tiers=("shared",)) == {("a", 0): 3, ("b", 0): 1}
        assert router.match(PROMPT, tiers=("shared",)) == {("a", 0): 3, ("b", 0): 0}

        # A dead store holds nothing: no error, the breaker opens after 3 failures.
        own_redis_server.kill()
        for _ in range(5):
            assert index.scores(PROMPT) == {("a", 0): 3.0, ("b", 0): 0.0}
        assert presence.metrics.breaker_trips == 1 and presence.metrics.skipped >= 2
    finally:
        for sub in (subscriber, events_only):
            sub.close()
        presence.close(timeout_s=1)
        for m in servers.values():
            m.close()


class CountingPresence:
    """A shared tier holding `held` pages, counting the questions."""

    def __init__(self, held):
        self.held, self.asked = held, []

    def holds(self, page_hashes):
        self.asked.append(len(page_hashes))
        return sum(1 for _ in itertools.takewhile(self.held.__contains__, page_hashes))


def test_the_store_is_asked_only_when_a_source_stops_short():
    presence = CountingPresence(set())
    index = PrefixRouterIndex(page_size=4, shared=presence)
    hashes = index.page_hashes(PROMPT)
    assert index.scores(PROMPT) == {} and presence.asked == []  # no source: no question
    index.apply(("a", 0), KVEventBatch(0.0, [BlockStored(hashes, None, list(PROMPT[:12]), 4,
                                                         None, "GPU", None)], 0))
    assert index.scores(PROMPT) == {("a", 0): 3.0} and presence.asked == []
    index.apply(("b", 0), KVEventBatch(0.0, [BlockStored(hashes[1:], hashes[0],
                                                         list(PROMPT[4:12]), 4, None, "GPU",
                                                         None)], 0))
    presence.held = {hashes[0]}  # b's page 0 from the store, then its own device pages
    assert index.scores(PROMPT) == {("a", 0): 3.0, ("b", 0): 2.25} and presence.asked == [3]
    assert index.match(PROMPT, tiers=("device", "host")) == {("a", 0): 3, ("b", 0): 0}
    assert presence.asked == [3]  # a query without the shared tier asks nothing
    with pytest.raises(TypeError, match="holds"):
        PrefixRouterIndex(page_size=4, shared=object())
