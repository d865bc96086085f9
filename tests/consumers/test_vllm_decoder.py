"""vLLM 0.33's own event classes (`vllm.distributed.kv_events`) read mokv's stream.

mokv declares the events as vLLM does; here that is checked against vLLM's classes
themselves, and a server's stream, decoded with vLLM's `KVEventBatch`, re-encodes to the
same bytes and rebuilds exactly what the server's tiers hold; the scores a router computes
from that vLLM-decoded state equal those of mokv's own index.
"""

import msgspec
import pytest
import zmq
from mokv.events.format import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from .conftest import PAGE_SIZE, Server, catch_up, follow

pytestmark = pytest.mark.consumers

kv_events = pytest.importorskip(
    "vllm.distributed.kv_events",
    reason="vLLM's decoder is not installed (make test-consumers: torch CPU, vllm --no-deps)",
)

WEIGHTS = {MEDIUM_GPU: 1.0, MEDIUM_CPU: 0.75}  # PrefixRouterIndex's defaults


def test_mokv_declares_the_events_as_vllm_does():
    pairs = ((BlockStored, kv_events.BlockStored), (BlockRemoved, kv_events.BlockRemoved),
             (AllBlocksCleared, kv_events.AllBlocksCleared), (KVEventBatch, kv_events.KVEventBatch))
    for mine, theirs in pairs:
        assert mine.__struct_fields__ == theirs.__struct_fields__, theirs.__name__
        assert mine.__struct_defaults__ == theirs.__struct_defaults__, theirs.__name__
        ours, vllms = mine.__struct_config__, theirs.__struct_config__
        assert (ours.tag, ours.tag_field, ours.array_like, ours.omit_defaults) == (
            vllms.tag, vllms.tag_field, vllms.array_like, vllms.omit_defaults), theirs.__name__
    assert (kv_events.MEDIUM_GPU, kv_events.MEDIUM_CPU) == (MEDIUM_GPU, MEDIUM_CPU)


def test_vllm_decodes_a_server_stream_and_rebuilds_its_tiers(session):
    server = Server(session, num_pages=8)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(server.endpoint)
    index, subscriber = follow({"s": server})
    catch_up(subscriber, {"s": server})  # the startup batch, through the replay socket
    while not sub.poll(50):  # PUB drops what it sends before the subscription arrives
        server.serve([7] * 5)
    sub.recv_multipart()

    prompt, salted, storm = list(range(13)), list(range(100, 109)), list(range(200, 229))
    server.serve(prompt)
    server.serve(salted, salt="tenant-a")
    server.serve(storm)  # the device evicts both; the host tier keeps their copies
    server.serve(prompt + [5])  # loaded back from the host tier
    assert server.m.metrics.cache_tokens_by_source["host"] == 12
    catch_up(subscriber, {"s": server})

    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    held: dict[str, set[int]] = {MEDIUM_GPU: set(), MEDIUM_CPU: set()}
    salts = []
    while sub.poll(200):
        topic, seq, payload = sub.recv_multipart()
        batch = decoder.decode(payload)
        assert msgspec.msgpack.encode(batch) == payload  # vLLM writes mokv's bytes
        for event in batch.events:
            if isinstance(event, kv_events.BlockStored):
                assert len(event.token_ids) == PAGE_SIZE * len(event.block_hashes)
                held[event.medium].update(event.block_hashes)
                salts += [k for k in event.extra_keys or () if k is not None]
            elif isinstance(event, kv_events.BlockRemoved):
                held[event.medium].difference_update(event.block_hashes)
            else:
                assert isinstance(event, kv_events.AllBlocksCleared)
                held = {medium: set() for medium in held}
    replica = server.m.replicas[0]
    assert held[MEDIUM_GPU] == replica.pool.indexed_hashes() == index.hashes(("s", 0), "device")
    host = replica.tiers.named("host").pool.indexed_hashes()
    assert held[MEDIUM_CPU] == host == index.hashes(("s", 0), "host") and host
    assert salts == [("tenant-a",)] * 2  # vLLM's form, on the device's and the host's first page

    for tokens, salt in ((prompt, None), (salted, "tenant-a"), (salted, None), (storm, None)):
        score = 0.0
        for h in index.page_hashes(tokens, salt):  # a router over vLLM's decoded state
            weight = max((WEIGHTS[m] for m, hs in held.items() if h in hs), default=None)
            if weight is None:
                break
            score += weight
        assert index.scores(tokens, salt)[("s", 0)] == score
    sub.close()
    subscriber.close()
    server.m.close()
