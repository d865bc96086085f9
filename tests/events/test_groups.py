"""KV-cache events and the router index on a cache of groups (issue 52 item 5): each
group's pages are announced under vLLM 0.33's `group_idx`, `kv_cache_spec_kind` and
`kv_cache_spec_sliding_window`, over a real ZMQ socket, and the router index scores the
joint prefix hit the manager itself finds."""

import time

import mokv
import numpy as np
import pytest
from mokv import CacheGroupConfig, TextContext
from mokv.events import KVEventsConfig, PrefixRouterIndex
from mokv.events.format import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from mokv.events.publisher import EventRecorder, build_events

from ..managers.conftest import LATENT, ROPE, make_paged
from ..tiers.test_groups import HOST_BYTES, serve_filled
from .conftest import inproc_name

SOURCE = ("server", 0)
GROUPS = (CacheGroupConfig("sliding", 1, window_size=6),
          CacheGroupConfig("full", 1, n_kv_heads=1, head_dim=16))


def publishing(session, endpoint: str) -> mokv.PagedKVCacheManager:
    m = make_paged(session, num_pages=16, max_seq_len=32, groups=GROUPS,
                   tiers=(mokv.HostTierConfig(swap_space_gb=HOST_BYTES / 2**30),),
                   kv_events=KVEventsConfig(endpoint, topic="kv@p@m"))
    deadline = time.monotonic() + 5
    while m.kv_event_publishers[0].num_published < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    return m


def stored(hashes, tokens, medium, group_idx, kind, window):
    return BlockStored(hashes, None, tokens, 4, None, medium, None, extra_keys=[None] * 4,
                       group_idx=group_idx, kv_cache_spec_kind=kind,
                       kv_cache_spec_sliding_window=window)


def test_each_groups_pages_are_announced_with_vllms_group_fields(session, reader_factory):
    endpoint = inproc_name()
    m = publishing(session, endpoint)
    reader = reader_factory(endpoint)
    serve_filled(m, TextContext(np.arange(17), "A"), seed=1)
    hashes = m.replicas[0].committed_hashes("A")
    (_, seq, payload), = reader.take(1)
    assert int.from_bytes(seq, "big") == 1
    tokens = list(range(16))
    assert BatchDecoder().decode(payload).events == [
        stored(hashes, tokens, "GPU", 0, "sliding_window", 6),
        stored(hashes, tokens, "GPU", 1, "full_attention", None),
        stored(hashes, tokens, "CPU", 0, "sliding_window", 6),
        stored(hashes, tokens, "CPU", 1, "full_attention", None),
    ]
    # Requests of other tokens take the memory the groups share: a group whose cached
    # pages are evicted announces each removal with its own group_idx.
    m.release("A")
    groups = m.replicas[0].groups
    removed: set[tuple[int, int, str]] = set()
    for i in range(4):
        if any(set(hashes) - g.pool.indexed_hashes() for g in groups):
            break
        serve_filled(m, TextContext(np.arange(31) + 1000 * (i + 1), f"X{i}"), seed=10 + i)
        m.release(f"X{i}")
        (_, _, payload), = reader.take(1)
        removed |= {(e.group_idx, h, e.medium) for e in BatchDecoder().decode(payload).events
                    if isinstance(e, BlockRemoved) for h in e.block_hashes}
    lost = {(g.index, h, "GPU") for g in groups for h in hashes
            if h not in g.pool.indexed_hashes()}
    assert lost and {r for r in removed if r[1] in hashes} == lost
    m.close()


def test_the_router_index_scores_the_managers_joint_hit(session, reader_factory):
    """The index rebuilt from the events holds, per group and tier, exactly the pools'
    hashes, and finds the prefix the manager would serve after one group lost its device
    pages of it (to the memory the groups share): the other group's device pages and the
    host copies of the lost ones; a page weighs its slowest needed copy."""
    endpoint = inproc_name()
    m = publishing(session, endpoint)
    reader = reader_factory(endpoint)
    index = PrefixRouterIndex(page_size=4)
    serve_filled(m, TextContext(np.arange(17), "A"), seed=1)
    hashes = m.replicas[0].committed_hashes("A")
    m.release("A")
    batches = 1
    r = m.replicas[0]
    needed = {0: set(hashes[2:]), 1: set(hashes)}  # the window reads 2 pages
    for i in range(4):
        if any(needed[g.index] - g.pool.indexed_hashes() for g in r.groups):
            break
        serve_filled(m, TextContext(np.arange(31) + 1000 * (i + 1), f"X{i}"), seed=10 + i)
        m.release(f"X{i}")
        batches += 1
    decoder = BatchDecoder()
    for _, _, payload in reader.take(batches):
        index.apply(SOURCE, decoder.decode(payload))
    assert index.windows(SOURCE) == {0: 6, 1: None}
    for g, stack in zip(r.groups, r.group_tiers):
        assert index.hashes(SOURCE, "device", g.index) == g.pool.indexed_hashes()
        assert index.hashes(SOURCE, "host", g.index) == stack.named("host").pool.indexed_hashes()
    prompt = np.r_[np.arange(16), [99]]
    # the devices alone serve none of it (a group's pages are in its host tier only)
    assert m.prefix_hit_pages(TextContext(prompt, "B")) == [(0, 4)]
    assert index.match(prompt) == {SOURCE: 4}
    assert index.match(prompt, tiers=("device",)) == {SOURCE: 0}
    weights = [min(1.0 if h in g.pool.indexed_hashes() else 0.75
                   for g in r.groups if h in needed[g.index]) for h in hashes]
    assert index.scores(prompt) == {SOURCE: sum(weights)} and min(weights) == 0.75
    m.close()


def group_batch(*events) -> KVEventBatch:
    return KVEventBatch(0.0, list(events), 0)


@pytest.mark.parametrize("window_pages, expected", [
    ([2, 3], 4),     # the window before page 4 is held: the whole prefix
    ([0, 1, 2], 3),  # page 3 is missing: the window before page 3 (pages 1, 2) is held
    ([0, 2], 1),     # pages 1 and 3 missing: only the window before page 1 (page 0)
    ([1], 0),        # no window before any end is whole
])
def test_a_windows_hit_is_a_suffix_run_and_the_joint_hit_is_iterated(window_pages, expected):
    index = PrefixRouterIndex(page_size=4)
    tokens = np.arange(17)
    hashes = index.page_hashes(tokens)
    index.apply(SOURCE, group_batch(
        BlockStored(hashes, None, list(range(16)), 4, None, "GPU", None, group_idx=1,
                    kv_cache_spec_kind="full_attention"),
        *[BlockStored([hashes[i]], hashes[i - 1] if i else None, list(range(4 * i, 4 * i + 4)),
                      4, None, "GPU", None, group_idx=0, kv_cache_spec_kind="sliding_window",
                      kv_cache_spec_sliding_window=6) for i in window_pages],
    ))
    assert index.match(tokens) == {SOURCE: expected}
    # A one-group source of the same pages: its run, whatever the other group holds.
    index.apply(("plain", 0), group_batch(
        BlockStored(hashes, None, list(range(16)), 4, None, "GPU", None)))
    assert index.match(tokens)[("plain", 0)] == 4


def test_a_reset_clears_every_group_and_tier_with_one_event(session):
    m = make_paged(session, num_pages=16, max_seq_len=32, groups=GROUPS,
                   tiers=(mokv.HostTierConfig(swap_space_gb=HOST_BYTES / 2**30),))
    recorder = EventRecorder()
    m.replicas[0].publish_to(recorder)
    serve_filled(m, TextContext(np.arange(9), "A"), seed=1)
    m.release("A")
    recorder.take()
    assert m.reset_prefix_cache()
    assert build_events(recorder.take(), 4) == [AllBlocksCleared()]
    r = m.replicas[0]
    assert not any(g.pool.indexed_hashes() for g in r.groups)
    assert not any(stack.named("host").pool.indexed_hashes() for stack in r.group_tiers)


def test_an_mla_groups_pages_are_announced_as_vllms_mla_attention(session):
    groups = (CacheGroupConfig("sliding", 1, window_size=6),
              CacheGroupConfig("latent", 1, latent_dim=LATENT, rope_dim=ROPE))
    m = make_paged(session, num_pages=16, max_seq_len=32, groups=groups)
    recorder = EventRecorder()
    m.replicas[0].publish_to(recorder)
    serve_filled(m, TextContext(np.arange(9), "A"), seed=1)
    hashes = m.replicas[0].committed_hashes("A")
    events = build_events(recorder.take(), 4)
    assert [(e.block_hashes, e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
            for e in events] == [(hashes, 0, "sliding_window", 6), (hashes, 1, "mla_attention", None)]
    index = PrefixRouterIndex(page_size=4)
    index.apply(SOURCE, KVEventBatch(0.0, events, 0))
    assert index.match(np.arange(9)) == {SOURCE: 2}
