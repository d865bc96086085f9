"""The page store on a real Redis Cluster (3 masters, one replica each): pages spread over
the masters and round-trip bit for bit; a master killed and restarted mid-trace costs
misses, never an error or a wrong page, and only its own node's breaker opens."""

import logging
import time

import pytest
from mokv.config.tiers import RemoteTierConfig

from .conftest import chain, pages, put_all

NUM_CHAINS, CHAIN_PAGES = 6, 8


def expected_prefix(got, want) -> None:
    """`got` is a leading run of `want`, bit for bit (a miss shortens it, never alters it)."""
    assert len(got) <= len(want)
    for page, data in zip(got, want):
        assert bytes(page) == data.tobytes()


def test_pages_spread_over_the_masters_and_round_trip(redis_cluster, make_store):
    store = make_store(redis_cluster)
    links, datas = chain(48, seed=1), pages(48, seed=1)
    put_all(store, links, datas)
    expected_prefix(got := store.lookup(links), datas)
    assert len(got) == 48 and store.metrics.errors == store.metrics.redirects == 0
    holders = {store.nodes.node_of(store.key(h)).address for h, _ in links}
    assert holders == redis_cluster.masters()  # every master holds some of the 48 pages
    for address in holders:
        with redis_cluster.by_address(address).client() as client:
            assert client.dbsize() > 0


def test_a_master_killed_and_restarted_mid_trace_costs_misses_only(redis_cluster, make_store):
    store = make_store(redis_cluster, timeout_s=0.5)
    store.nodes.set_cooldown(0.2)  # the test waits for trials, not 5 s
    chains = [chain(CHAIN_PAGES, seed=10 + c) for c in range(NUM_CHAINS)]
    datas = [pages(CHAIN_PAGES, seed=10 + c) for c in range(NUM_CHAINS)]
    for links, data in zip(chains, datas):
        put_all(store, links, data)
    redis_cluster.sync_replicas()  # what the replica will serve once it takes over

    def trace_step() -> list[int]:
        hits = []
        for links, data in zip(chains, datas):
            got = store.lookup(links)  # never raises
            expected_prefix(got, data)
            hits.append(len(got))
        return hits

    assert trace_step() == [CHAIN_PAGES] * NUM_CHAINS
    victim = store.nodes.node_of(store.key(chains[0][0][0])).address
    others = redis_cluster.masters() - {victim}
    redis_cluster.by_address(victim).kill()

    # The dead master's pages miss; the others' are served (each chain up to its first
    # page on the dead master).
    on_victim = [[store.nodes.node_of(store.key(h)).address == victim for h, _ in links]
                 for links in chains]
    assert trace_step() == [(dead + [True]).index(True) for dead in on_victim]
    assert on_victim[0][0]
    deadline = time.monotonic() + 60  # a failover on two loaded cores can take a while
    while victim in redis_cluster.masters():  # its replica takes over
        assert time.monotonic() < deadline, "no failover"
        trace_step()
        time.sleep(0.05)
    assert store.nodes.node(victim).breaker.trips >= 1
    assert all(store.nodes.node(a).breaker.trips == 0 for a in others)
    # The store's slot map moves to the replica within a refresh (0.5 s); the cluster
    # may still say CLUSTERDOWN for a moment after the vote.
    deadline = time.monotonic() + 30
    while (hits := trace_step()) != [CHAIN_PAGES] * NUM_CHAINS:
        assert time.monotonic() < deadline, (
            f"the promoted replica was never asked: {hits}, {store.metrics}, "
            f"map {[n.address for n in store.nodes.masters()]}, "
            f"cluster {redis_cluster.masters()}"
        )
        time.sleep(0.05)

    redis_cluster.by_address(victim).start()  # rejoins as a replica of its successor
    redis_cluster.wait_ok()
    assert victim not in redis_cluster.masters()
    new = [chain(CHAIN_PAGES, seed=90)], [pages(CHAIN_PAGES, seed=90)]
    put_all(store, new[0][0], new[1][0])
    chains += new[0]
    datas += new[1]
    assert trace_step() == [CHAIN_PAGES] * (NUM_CHAINS + 1)
    m = store.metrics
    assert m.errors + m.timeouts >= 1 and m.rejected_corrupt == m.rejected_tokens == 0


def test_cluster_seeds_are_checked():
    ok = RemoteTierConfig(url=("redis://127.0.0.1:7000", "redis://u:pw@h:7001"), namespace="m")
    assert "pw" not in repr(ok) and "7001" in repr(ok)
    listed = RemoteTierConfig(url=["redis://127.0.0.1:7000"], namespace="m")  # from YAML
    assert listed.url == ("redis://127.0.0.1:7000",) and hash(listed)
    for bad, says in [
        ((), "one seed"),
        (("redis://h:7000/1",), "database 0"),
        (("unix:///tmp/r.sock",), "database 0"),
        (("redis://h:7000", "redis://h:7000"), "repeat"),
        (("redis://h:7000", 7001), "got int"),
        ({"redis://h:7000"}, "got set"),
    ]:
        with pytest.raises(ValueError, match=says):
            RemoteTierConfig(url=bad, namespace="m")



def test_a_failover_redirects_are_misses_then_the_new_master_serves(redis_cluster, make_store):
    # A graceful failover (CLUSTER FAILOVER on a replica): the old master, now a replica,
    # answers MOVED for its former slots. Each is a miss, not a failure: no breaker
    # trips, and once the slot map is asked for again the new master serves the pages.
    store = make_store(redis_cluster)
    links, datas = chain(24, seed=5), pages(24, seed=5)
    put_all(store, links, datas)
    redis_cluster.sync_replicas()
    assert len(store.lookup(links)) == 24
    old = store.nodes.node_of(store.key(links[0][0])).address
    new = redis_cluster.replica_of(old)
    with new.client() as client:
        client.execute_command("CLUSTER", "FAILOVER")
    deadline = time.monotonic() + 30
    while old in redis_cluster.masters():
        assert time.monotonic() < deadline, "no failover"
        time.sleep(0.05)
    redis_cluster.wait_ok()
    assert store.lookup(links) == []  # page 0's slot moved: MOVED, a miss
    assert store.metrics.redirects >= 1 and store.metrics.errors == 0
    while len(got := store.lookup(links)) < 24:
        assert time.monotonic() < deadline, "the new master was never asked"
        time.sleep(0.1)
    expected_prefix(got, datas)
    assert store.nodes.node_of(store.key(links[0][0])).address == f"127.0.0.1:{new.port}"
    assert store.metrics.breaker_trips == 0


def test_a_server_that_is_no_cluster_node_holds_nothing(redis_server, make_store, caplog):
    store = make_store(redis_server)  # one server: it works as such
    links, datas = chain(4, seed=6), pages(4, seed=6)
    put_all(store, links, datas)
    as_cluster = make_store(None, url=(redis_server.url.removesuffix("/0"),),
                            namespace=store.namespace)
    with caplog.at_level(logging.WARNING, logger="mokv.remote.nodes"):
        assert as_cluster.lookup(links) == [] and as_cluster.holds([h for h, _ in links]) == 0
    assert "cluster support disabled" in caplog.text
    assert as_cluster.metrics.skipped >= 1 and as_cluster.metrics.errors == 0
