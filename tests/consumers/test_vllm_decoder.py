"""vLLM 0.33's own event classes (`vllm.distributed.kv_events`) read mokv's stream.

mokv declares the events as vLLM does; here that is checked against vLLM's classes
themselves, and a server's stream, decoded with vLLM's `KVEventBatch`, re-encodes to the
same bytes and rebuilds exactly what the server's tiers hold; the scores a router computes
from that vLLM-decoded state equal those of mokv's own index.
"""

import mokv
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
from mokv.events.publisher import EventRecorder, build_events

from tests.managers.conftest import make_paged

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


def test_extra_keys_are_those_vllm_publishes_for_the_same_request(session):
    """A request under an adapter, with an image and a salt: mokv's per-page `extra_keys`,
    `lora_id` and `lora_name` equal what vLLM 0.33's block pool publishes for the same
    request (`generate_block_hash_extra_keys` -> `to_event_extra_keys`)."""
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys
    from vllm.v1.request import Request

    prompt = [1, 2, 3, 4, 5, 6, 7, 7, 7, 7, 7, 7, 9, 9, 9, 9, 8]
    images = [("img-a", 6, 6), ("img-b", 13, 2)]  # pages 1-2, and page 3
    theirs = Request("r", prompt, SamplingParams(max_tokens=1), None,
                     mm_features=[MultiModalFeatureSpec(None, "image", i, PlaceholderRange(o, n))
                                  for i, o, n in images],
                     lora_request=LoRARequest("math", 3, "/adapters/math"), cache_salt="tenant-a")
    keys, mm_idx = [], 0
    for start in range(0, 16, PAGE_SIZE):
        page_keys, mm_idx = generate_block_hash_extra_keys(theirs, start, start + PAGE_SIZE, mm_idx)
        keys.append(page_keys)
    m = make_paged(session, num_pages=8, max_seq_len=24)
    recorder = EventRecorder()
    m.replicas[0].pool.events = recorder
    ctx = mokv.TextContext(prompt, cache_salt="tenant-a", lora_name="math", lora_id=3,
                           mm_inputs=[mokv.MultimodalInput(*image) for image in images])
    m.external_claim(ctx.request_id)
    m.fetch([ctx])
    ctx.update(1)
    m.step([ctx])
    payload = msgspec.msgpack.encode(KVEventBatch(0.0, build_events(recorder.take(), PAGE_SIZE)))
    (event,) = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(payload).events
    # On the wire (msgpack has arrays only: vLLM decodes an image's pair back as a list).
    assert msgspec.msgpack.encode(event.extra_keys) == msgspec.msgpack.encode(
        to_event_extra_keys(keys))
    assert event.extra_keys[0] == ("math", "tenant-a") and event.extra_keys[3][1] == ["img-b", 1]
    assert (event.lora_id, event.lora_name) == (theirs.lora_request.adapter_id, "math")


def test_vllm_reads_each_cache_groups_fields(session):
    """A cache of a sliding and a full group: vLLM's classes decode each group's events
    with vLLM 0.33's `group_idx`, `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`,
    and re-encode them to the same bytes."""
    groups = (mokv.CacheGroupConfig("sliding", 1, window_size=6),
              mokv.CacheGroupConfig("full", 1))
    m = make_paged(session, num_pages=16, max_seq_len=32, groups=groups)
    recorder = EventRecorder()
    m.replicas[0].publish_to(recorder)
    ctx = mokv.TextContext(list(range(17)), "A")
    m.external_claim("A")
    m.fetch([ctx])
    ctx.update(1)
    m.step([ctx])
    payload = msgspec.msgpack.encode(KVEventBatch(1.5, build_events(recorder.take(), 4), 0))
    theirs = msgspec.msgpack.decode(payload, type=kv_events.KVEventBatch)
    assert [(type(e).__name__, e.block_hashes, e.group_idx, e.kv_cache_spec_kind,
             e.kv_cache_spec_sliding_window) for e in theirs.events] == [
        ("BlockStored", m.replicas[0].committed_hashes("A"), 0, "sliding_window", 6),
        ("BlockStored", m.replicas[0].committed_hashes("A"), 1, "full_attention", None)]
    assert msgspec.msgpack.encode(theirs) == payload


def test_vllm_reads_state_checkpoints_as_its_mamba_kind(session):
    """A cache with recurrent-state layers: its checkpoints' events decode with vLLM's own
    classes as blocks of one more group, of `KVCacheSpecKind.MAMBA`, under their boundary
    pages' hashes, and re-encode to the same bytes."""
    from vllm.v1.kv_cache_interface import KVCacheSpecKind

    from tests.managers.paged.test_state_group import SHARED, hybrid, prefill

    m = hybrid(session, checkpoints=1)  # a second checkpoint evicts the first
    recorder = EventRecorder()
    m.replicas[0].publish_to(recorder)
    prefill(m, "A", SHARED + [5, 5])  # checkpoints after pages 1 and 2
    h1, h2 = m.replicas[0].committed_hashes("A")
    payload = msgspec.msgpack.encode(KVEventBatch(2.5, build_events(recorder.take(), 4), 0))
    theirs = msgspec.msgpack.decode(payload, type=kv_events.KVEventBatch)
    assert msgspec.msgpack.encode(theirs) == payload
    state = [(type(e).__name__, e.block_hashes, e.kv_cache_spec_kind if isinstance(
        e, kv_events.BlockStored) else None) for e in theirs.events if e.group_idx == 1]
    mamba = KVCacheSpecKind.MAMBA.value
    assert state == [("BlockStored", [h1], mamba), ("BlockRemoved", [h1], None),
                     ("BlockStored", [h2], mamba)]
    m.close()
