"""NVIDIA Dynamo's standalone KV indexer (ai-dynamo-runtime 1.6.1) follows two mokv servers
and answers every query as mokv's own index does, tier by tier.

Dynamo hashes the query's tokens itself and maps each event's block hashes to its own, so
its answer is an independent reading of mokv's stream. Its `/query` reply gives, per
worker and data-parallel rank, the leading tokens held on the device (`scores`), and per
worker the leading tokens held on the device or in host memory (`instances[w]["cpu"]`)
and in any tier (`longest_matched`).

The scenario covers the issue-40 mismatches Dynamo showed: replicas on the CPU device
("GPU" medium: device credit), host copies ("CPU": host credit only), salted pages (the
"dynamo" salt form: isolated), and a reset while a request runs (refused: the request's
next page is indexed, not dropped for a missing parent).
"""

import time

import pytest

from .conftest import PAGE_SIZE, Server, catch_up, follow

pytestmark = pytest.mark.consumers

P = list(range(13))  # three full pages
S = list(range(100, 109))  # two full pages, served salted
R = list(range(300, 309))  # a request that keeps running
STORM = list(range(200, 229))  # seven full pages: evicts the device


def register(indexer, server, worker: int, timeout=15.0) -> None:
    """Registers `server` as `worker` and waits until Dynamo's listener hears it: Dynamo
    replays a gap it sees, but not what a PUB socket sent before it connected. Then
    resets the server, so both indexes start from one AllBlocksCleared."""
    indexer.post("/register", {
        "instance_id": worker, "endpoint": server.endpoint, "replay_endpoint": server.replay,
        "model_name": "mokv", "block_size": PAGE_SIZE})
    deadline = time.monotonic() + timeout
    for probe in range(10_000):
        tokens = [50_000 + 1000 * worker + 5 * probe + k for k in range(5)]
        server.serve(tokens)
        time.sleep(0.1)
        if str(worker) in dynamo_view_raw(indexer, tokens, None).get("scores", {}):
            break
        assert time.monotonic() < deadline, "Dynamo's listener never heard the server"
    assert server.m.reset_prefix_cache()


def dynamo_view_raw(indexer, tokens, salt) -> dict:
    body = {"model_name": "mokv", "token_ids": tokens}
    if salt is not None:
        body["cache_salt"] = salt
    return indexer.post("/query", body)


def dynamo_view(indexer, tokens, salt, workers) -> dict:
    reply = dynamo_view_raw(indexer, tokens, salt)
    view = {}
    for name, worker in workers.items():
        inst = reply.get("instances", {}).get(str(worker), {})
        view[name] = (
            reply.get("scores", {}).get(str(worker), {}).get("0", 0),
            inst.get("cpu", 0),
            inst.get("longest_matched", 0),
        )
    return view


def mokv_view(index, tokens, salt, names) -> dict:
    device = index.match(tokens, salt, tiers=("device",))
    near = index.match(tokens, salt, tiers=("device", "host"))
    held = index.match(tokens, salt)
    return {
        n: tuple(PAGE_SIZE * c.get((n, 0), 0) for c in (device, near, held)) for n in names
    }


def assert_agree(indexer, index, queries, workers, timeout=15.0):
    """Dynamo answers every query as mokv's index does (its events apply asynchronously:
    waits for them, then compares)."""
    deadline = time.monotonic() + timeout
    while True:
        got = {q: dynamo_view(indexer, list(q[0]), q[1], workers) for q in queries}
        want = {q: mokv_view(index, list(q[0]), q[1], workers) for q in queries}
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert got == want


def test_dynamo_indexes_mokv_servers_as_mokv_does(session, dynamo_indexer):
    servers = {"a": Server(session, num_pages=8, salt_format="dynamo"),
               "b": Server(session, num_pages=8, salt_format="dynamo")}
    workers = {"a": 1, "b": 2}
    index, subscriber = follow(servers)
    for name, server in servers.items():
        register(dynamo_indexer, server, workers[name])
    a, b = servers["a"], servers["b"]
    queries = [(tuple(P), None), (tuple(S), "t"), (tuple(S), None), (tuple(R), None),
               (tuple(STORM), None)]

    a.serve(P)
    b.serve(P)
    a.serve(STORM)  # a's copy of P leaves its device; the host tier keeps it
    b.serve(S, salt="t")
    running = a.start(R)  # keeps its pages
    assert a.m.reset_prefix_cache() is False  # refused: nothing cleared, nothing published
    for token in (2, 3, 4):  # R decodes on: its third page fills and is committed
        a.m.fetch([running])
        running.update(token)
        a.m.step([running])
    catch_up(subscriber, servers)
    assert mokv_view(index, P, None, "ab") == {"a": (0, 12, 12), "b": (12, 12, 12)}
    assert mokv_view(index, S, "t", "ab")["b"] == (8, 8, 8)
    assert mokv_view(index, S, None, "ab")["b"] == (0, 0, 0)  # salted pages stay apart
    assert index.best(P) == (("b", 0), 3.0)  # on b's device; a would load it from host
    assert index.match(R + [1, 2, 3, 4], tiers=("device",))[("a", 0)] == 3
    assert_agree(dynamo_indexer, index, queries + [(tuple(R + [1, 2, 3, 4]), None)], workers)

    a.m.release(running.request_id)
    assert b.m.reset_prefix_cache() is True
    catch_up(subscriber, servers)
    assert mokv_view(index, P, None, "ab")["b"] == (0, 0, 0)
    assert_agree(dynamo_indexer, index, queries, workers)
    subscriber.close()
    for server in servers.values():
        server.m.close()
