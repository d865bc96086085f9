"""What a manager publishes: a scripted scenario's exact event sequence (one replica and
two), both payload forms, the bind/connect topologies, and a full queue's counted drop."""

import mokv
import msgspec
import numpy as np
import pytest
from mokv.cache.hashing import page_hash_fn, page_hashes, root_hash, salted_root
from mokv.config.events import offset_endpoint
from mokv.events import KVEventsConfig, PrefixRouterIndex
from mokv.events.format import BatchDecoder

from ..managers.conftest import mla
from .conftest import free_port, inproc_name, make_publishing
from .test_format import VAllBlocksCleared, VBlockRemoved, VBlockStored, decode_like_vllm

FN, ROOT = page_hash_fn("xxh3"), root_hash("xxh3", 0)


def hashes(tokens, salt=None):
    root = ROOT if salt is None else salted_root("xxh3", 0, salt)
    return page_hashes(np.asarray(tokens), 4, root, FN)


def run_request(m, tokens, replica=None, salt=None):
    """Claims, fetches, decodes one step (token 100) and steps one request; returns it."""
    ctx = mokv.TextContext(tokens, cache_salt=salt)
    m.external_claim(ctx.request_id, replica)
    m.fetch([ctx])
    ctx.update(100)
    m.step([ctx])
    return ctx


def stored(hs, parent, tokens, extra=None):
    return VBlockStored(hs, parent, list(tokens), 4, None, "GPU", None,
                        extra_keys=extra or [None] * len(hs), group_idx=0,
                        kv_cache_spec_kind="full_attention")


def removed(h):
    return VBlockRemoved([h], "GPU", group_idx=0)


def scripted(m, replica=None):
    """Startup, two pages stored, evicted by a four-page request, a reset. The events
    each batch must hold, decoded with vLLM's structs."""
    a = run_request(m, range(10), replica)  # 3 pages, the first 2 full when stepped
    h0, h1 = hashes(range(8))
    m.release(a.request_id)  # tail first: h1 joins the LRU before h0
    c = run_request(m, range(20, 36), replica)  # needs all 4 pages: evicts h1, then h0
    b = hashes(range(20, 36))
    m.release(c.request_id)  # a reset waits for the requests holding pages (vLLM's rule)
    assert m.reset_prefix_cache()
    return [
        [VAllBlocksCleared()],
        [stored([h0, h1], None, range(8))],
        [removed(h1), removed(h0), stored(b, None, range(20, 36))],
        [VAllBlocksCleared()],
    ]


@pytest.mark.parametrize("form", ["map", "array"])
@pytest.mark.parametrize("cache", ["heads", "mla"])
def test_one_replica_publishes_the_scripted_sequence(session, reader_factory, form, cache):
    """The same events whether the pages hold K and V heads or MLA latents (an MLA page
    serves every token before it, as a full-attention page does)."""
    endpoint = inproc_name()
    config = KVEventsConfig(endpoint, payload_format=form, topic="kv@p@m")
    m = make_publishing(session, config, **(mla() if cache == "mla" else {}))
    reader = reader_factory(endpoint)
    # The startup batch (seq 0) went out before the reader connected; it is checked
    # through the replay socket below.
    expected = scripted(m)
    msgs = reader.take(3)
    assert [int.from_bytes(seq, "big") for _, seq, _ in msgs] == [1, 2, 3]
    assert all(topic == b"kv@p@m" for topic, _, _ in msgs)
    decode = decode_like_vllm if form == "map" else BatchDecoder().decode
    for (_, _, payload), events in zip(msgs, expected[1:]):
        batch = decode(payload)
        assert batch.data_parallel_rank == 0
        got = [(type(e).__name__.lstrip("V"), *[getattr(e, f) for f in e.__struct_fields__
                                                 if f in VBlockStored.__struct_fields__])
               for e in batch.events]
        want = [(type(e).__name__.lstrip("V"), *[getattr(e, f) for f in e.__struct_fields__])
                for e in events]
        assert got == want
    m.close()


def test_startup_clear_is_seq_zero_and_replayable(session):
    import zmq

    endpoint, replay = inproc_name(), inproc_name()
    m = make_publishing(session, KVEventsConfig(endpoint, replay_endpoint=replay))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    assert dealer.poll(3000)
    empty, topic, seq, payload = dealer.recv_multipart()
    assert (empty, topic, seq) == (b"", b"", (0).to_bytes(8, "big"))
    assert decode_like_vllm(payload).events == [VAllBlocksCleared()]
    assert dealer.recv_multipart() == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    dealer.close()
    m.close()


def test_two_replicas_publish_on_their_own_endpoints(session, reader_factory):
    port = free_port()
    config = KVEventsConfig(f"tcp://*:{port}")
    m = make_publishing(session, config, dp=2)
    assert [p.endpoint for p in m.kv_event_publishers] == [
        f"tcp://0.0.0.0:{port}", f"tcp://0.0.0.0:{port + 1}"]
    readers = [reader_factory(f"tcp://127.0.0.1:{port + r}") for r in range(2)]
    expected = {r: scripted(m, replica=r) for r in range(2)}
    for r, reader in enumerate(readers):
        msgs = reader.take(4)  # both resets reach both replicas
        batches = [decode_like_vllm(p) for _, _, p in msgs]
        assert {b.data_parallel_rank for b in batches} == {r}
        events = [e for b in batches for e in b.events]
        own = [e for batch in expected[r][1:3] for e in batch]
        assert [e for e in events if not isinstance(e, VAllBlocksCleared)] == own
    m.close()


def test_connect_topology_router_binds(session, reader_factory):

    reader = reader_factory(inproc_name())
    port = reader.sock.bind_to_random_port("tcp://127.0.0.1")  # llm-d: the router binds
    m = make_publishing(session, KVEventsConfig(f"tcp://127.0.0.1:{port}"), num_pages=16)
    sent = {}
    for i in range(50):  # until the connection and subscription are up (PUB drops before)
        tokens = range(100 * i, 100 * i + 8)
        m.release(run_request(m, tokens).request_id)
        sent[i] = hashes(tokens)
        if reader.sock.poll(100):
            break
    batch = decode_like_vllm(reader.take(1)[0][2])
    assert batch.events[-1].block_hashes in sent.values()
    m.close()


def test_salted_first_page_carries_its_salt(session, reader_factory):
    endpoint = inproc_name()
    m = make_publishing(session, KVEventsConfig(endpoint))
    reader = reader_factory(endpoint)
    run_request(m, range(9), salt="tenant-a")
    (event,) = decode_like_vllm(reader.take(1)[0][2]).events
    assert event.extra_keys == [("tenant-a",), None]
    assert event.block_hashes == hashes(range(8), "tenant-a") != hashes(range(8))
    m.close()


@pytest.mark.parametrize(("salt_format", "extra", "top_level"), [
    ("vllm", ("tenant-a",), None),
    ("dynamo", ("dynamo-cache-salt:tenant-a",), None),  # the only salt Dynamo's router reads
    ("sglang", ("tenant-a",), "tenant-a"),  # SGLang's router reads a top-level cache_salt
])
def test_salt_format_writes_the_salt_a_router_reads(session, reader_factory, salt_format,
                                                     extra, top_level):
    endpoint = inproc_name()
    m = make_publishing(session, KVEventsConfig(endpoint, salt_format=salt_format), num_pages=8)
    reader = reader_factory(endpoint)
    m.release(run_request(m, range(9), salt="tenant-a").request_id)
    m.release(run_request(m, range(50, 59)).request_id)  # unsalted: no salt in any form
    salted, plain = (msgspec.msgpack.decode(p)[1][0] for _, _, p in reader.take(2))
    assert salted["extra_keys"] == [list(extra), None] and plain["extra_keys"] == [None, None]
    assert salted.get("cache_salt") == top_level and "cache_salt" not in plain
    assert salted["block_hashes"] == hashes(range(8), "tenant-a")  # the hashes never change
    (event,) = decode_like_vllm(msgspec.msgpack.encode([0.0, [salted]])).events
    assert event.extra_keys == [extra, None]  # vLLM's structs still decode every form
    m.close()


def test_empty_salt_is_no_salt_as_in_vllm(session, reader_factory):
    # vLLM salts a request only when its cache_salt is truthy: "" shares the unsalted
    # pages and publishes no salt.
    endpoint = inproc_name()
    m = make_publishing(session, KVEventsConfig(endpoint), num_pages=8)
    reader = reader_factory(endpoint)
    m.release(run_request(m, range(9), salt="").request_id)
    (event,) = decode_like_vllm(reader.take(1)[0][2]).events
    assert event.extra_keys == [None, None] and event.block_hashes == hashes(range(8))
    again = mokv.TextContext(np.arange(10))  # unsalted: finds the "" request's pages
    m.external_claim(again.request_id)
    assert m.maybe_reserve(again) and again.start_idx == 8
    m.release(again.request_id)
    assert salted_root("xxh3", 0, "") == ROOT
    m.close()


def test_primary_cache_medium_is_gpu_on_every_device(session, reader_factory):
    # vLLM publishes "GPU" for its primary cache on the CPU platform too and keeps "CPU"
    # for offloaded copies: routers (Dynamo, SGLang) file "CPU" under their host tier.
    endpoint = inproc_name()
    m = make_publishing(session, KVEventsConfig(endpoint))  # a replica on the CPU device
    assert m.devices[0].is_host
    reader = reader_factory(endpoint)
    a = run_request(m, range(10))
    m.release(a.request_id)
    m.release(run_request(m, range(20, 36)).request_id)  # evicts a's pages
    mediums = [e.medium for _, _, p in reader.take(2) for e in decode_like_vllm(p).events]
    assert mediums == ["GPU", "GPU", "GPU", "GPU"]
    m.close()


def test_reset_under_running_requests_publishes_nothing(session, reader_factory):
    # The stream never announces a page whose parent it has cleared: a reset that would
    # clear the pages a running request holds is refused and publishes no batch.
    endpoint = inproc_name()
    m = make_publishing(session, KVEventsConfig(endpoint), num_pages=8)
    reader = reader_factory(endpoint)
    a = run_request(m, range(10))  # holds two committed pages
    (first,) = decode_like_vllm(reader.take(1)[0][2]).events
    assert m.reset_prefix_cache() is False
    a.update(101)
    a.update(102)
    m.fetch([a])  # reserves the third page ...
    a.update(103)
    m.step([a])  # ... which this step fills and commits, chained to the second
    (second,) = decode_like_vllm(reader.take(1)[0][2]).events
    assert second.parent_block_hash == first.block_hashes[-1]  # announced, never cleared
    assert not reader.sock.poll(100)  # the refused reset published nothing
    m.release(a.request_id)
    assert m.reset_prefix_cache() is True
    assert decode_like_vllm(reader.take(1)[0][2]).events == [VAllBlocksCleared()]
    m.close()


def test_endpoint_offsets():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://*:0", 3) == "tcp://*:0"
    assert offset_endpoint("inproc://x", 2) == "inproc://x_dp2"
    assert offset_endpoint("ipc:///tmp/x", 1) == "ipc:///tmp/x_dp1"
    c = KVEventsConfig()
    assert (c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm, c.max_queue_size, c.topic,
            c.payload_format, c.salt_format) == (
        "tcp://*:5557", None, 10_000, 100_000, 100_000, "", "map", "vllm")
    with pytest.raises(ValueError, match="payload_format"):
        KVEventsConfig(payload_format="json")
    with pytest.raises(ValueError, match="'trtllm'"):
        KVEventsConfig(salt_format="trtllm")
    with pytest.raises(ValueError, match="payload_format='array'"):
        KVEventsConfig(salt_format="sglang", payload_format="array")


def test_full_queue_drops_oldest_and_counts(session):
    from mokv.events import EventPublisher

    p = EventPublisher(KVEventsConfig(inproc_name(), max_queue_size=1), 0, 4)
    p._wake.wait = lambda timeout: None  # hold the thread back: batches pile up
    for i in range(50):
        p.removed(i)
        p.end_step()
    assert p.num_dropped > 0 and p.last_seq == 50
    p.close()


def test_adapter_images_salt_and_session_travel_as_vllm_publishes_them(session, reader_factory):
    # vLLM 0.33 (`to_event_extra_keys`): per page the LoRA name, (identifier, offset in
    # the page) of each image it overlaps, then the salt on the first page; lora_id,
    # lora_name and session_id on the event. A router hashing the same keys matches.
    endpoint = inproc_name()
    m = make_publishing(session, KVEventsConfig(endpoint), num_pages=8)
    reader = reader_factory(endpoint)
    prompt, image = [1, 2, 3, 4, 5, 6, 7, 7, 7, 7, 9, 9, 8], mokv.MultimodalInput("img-a", 6, 4)
    ctx = mokv.TextContext(prompt, cache_salt="tenant-a", lora_name="math", lora_id=3,
                           mm_inputs=[image], session_id="agent-1")
    m.external_claim(ctx.request_id)
    m.fetch([ctx])
    ctx.update(100)
    m.step([ctx])
    payload = reader.take(1)[0][2]
    (event,) = decode_like_vllm(payload).events
    assert (event.lora_id, event.lora_name, event.session_id) == (3, "math", "agent-1")
    assert event.extra_keys == [("math", "tenant-a"), ("math", ["img-a", 2]),
                                ("math", ["img-a", -2])]
    assert event.block_hashes == m.replicas[0].committed_hashes(ctx.request_id)
    index = PrefixRouterIndex(page_size=4)
    index.apply(("server", 0), BatchDecoder().decode(payload))
    ask = dict(lora_name="math", mm_inputs=[image])
    assert index.match(prompt, "tenant-a", **ask) == {("server", 0): 3}
    assert index.match(prompt, "tenant-a", lora_name="math") == {("server", 0): 1}  # no image
    assert index.match(prompt, "tenant-a", mm_inputs=[image]) == {("server", 0): 0}  # no adapter
    assert index.match(prompt, lora_name="math", mm_inputs=[image]) == {("server", 0): 0}
    m.close()
