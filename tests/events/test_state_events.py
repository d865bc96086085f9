"""KV-cache events of a cache with recurrent-state layers (`KVCacheParams.recurrent`):
each checkpoint taken or evicted on the device is announced as a block of one more
cache group after the attention groups, vLLM's state kind ("mamba"), under its boundary
page's hash, parent and tokens, over a real ZMQ socket; the router index rebuilt from
them holds exactly the checkpoint pool's hashes and scores the joint hit the manager
finds, which stops at the last checkpoint the attention pages reach."""

import time

import numpy as np
from mokv import CacheGroupConfig, RecurrentStateConfig, TextContext
from mokv.events import KVEventsConfig, PrefixRouterIndex
from mokv.events.format import BatchDecoder, BlockRemoved, BlockStored

from ..managers.conftest import NUM_LAYERS, make_paged
from ..managers.paged.test_state_group import SHARED, STACK, prefill
from .conftest import inproc_name

SOURCE = ("server", 0)


def publishing(session, endpoint):
    """One device slot for checkpoints: a second one evicts the first."""
    state = RecurrentStateConfig("linear_attention", STACK.regions(), num_checkpoints=1)
    m = make_paged(session, num_pages=24, max_seq_len=64, recurrent=state,
                   groups=(CacheGroupConfig("full_attention", NUM_LAYERS),),
                   kv_events=KVEventsConfig(endpoint, topic="kv@p@m"))
    deadline = time.monotonic() + 5
    while m.kv_event_publishers[0].num_published < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    return m


def test_checkpoints_are_announced_as_a_state_group_and_the_index_scores_the_joint_hit(
        session, reader_factory):
    endpoint = inproc_name()
    m = publishing(session, endpoint)
    reader = reader_factory(endpoint)
    prefill(m, "A", SHARED + [5, 5])  # checkpoints after pages 1 and 2 (one slot)
    h1, h2 = m.replicas[0].committed_hashes("A")
    decoder = BatchDecoder()
    batches = [decoder.decode(payload) for _, _, payload in reader.take(2)]
    events = [e for batch in batches for e in batch.events]
    state = [e for e in events if e.group_idx == 1]
    assert state == [
        BlockStored([h1], None, SHARED[:4], 4, None, "GPU", None, extra_keys=[None],
                    group_idx=1, kv_cache_spec_kind="mamba"),
        BlockRemoved([h1], "GPU", group_idx=1),
        BlockStored([h2], h1, SHARED[4:8], 4, None, "GPU", None, extra_keys=[None],
                    group_idx=1, kv_cache_spec_kind="mamba"),
    ]
    assert [e.kv_cache_spec_kind for e in events if e.group_idx == 0] == ["full_attention"] * 2
    index = PrefixRouterIndex(page_size=4)
    for batch in batches:
        index.apply(SOURCE, batch)
    states = m.replicas[0].states
    assert index.hashes(SOURCE, "device", 1) == states.pool.indexed_hashes() == {h2}
    m.release("A")
    for prompt, pages in ((SHARED[:8] + [60, 61], 2), (SHARED[:4] + [60, 61], 0)):
        ctx = TextContext(np.array(prompt), "B")
        assert m.prefix_hit_pages(ctx) == [(pages, 0)]
        assert index.match(prompt) == {SOURCE: pages}  # page 1's checkpoint is gone
    m.close()
