"""The host and shared tiers on a cache of groups (issue 52 item 5, issue 54 item 1): each
group's committed pages go to its own tiers in its own page layout, and a tier hit on a
joint prefix loads, bit for bit, the pages each group needs (a sliding group only its
window's), on real MAX buffers and a real redis-server."""

from collections import Counter

import mokv
import numpy as np
import pytest
from mokv import CacheGroupConfig, TextContext
from mokv.cache import page_copy

from ..managers.conftest import LATENT, ROPE, make_paged
from .test_remote import fresh_namespace

PAGE = 4
WINDOW = 6  # reads the page it writes and the 2 before it (ceil(5 / 4) = 2)
HOST_BYTES = 2**16


def cache_groups(kind: str) -> tuple[CacheGroupConfig, ...]:
    """A sliding group (the params' 2 heads of 8) and a full group of another head shape
    (one head of 16), or an MLA group (a latent row of 16 + 8): one layer each."""
    other = (
        CacheGroupConfig("latent", 1, latent_dim=LATENT, rope_dim=ROPE)
        if kind == "mla"
        else CacheGroupConfig("full", 1, n_kv_heads=1, head_dim=16)
    )
    return (CacheGroupConfig("sliding", 1, window_size=WINDOW), other)


def make(session, kind: str, tier, num_pages: int = 16, **fields) -> mokv.PagedKVCacheManager:
    """The groups share the device memory of `num_pages` pages of two layers (8: one
    request of 32 tokens takes it all)."""
    return make_paged(session, num_pages=num_pages, max_seq_len=32, groups=cache_groups(kind),
                      tiers=(tier,), **fields)


def host_config() -> mokv.HostTierConfig:
    return mokv.HostTierConfig(swap_space_gb=HOST_BYTES / 2**30)


def leaves(group) -> list[np.ndarray]:
    """Aliasing views of the group's buffers on the first device: its values, and the
    scales of scaled pages."""
    return [page_copy.numpy_view(b[0]) for b in (group.blocks, group.scales) if b]


def serve_filled(m, ctx: TextContext, seed: int) -> dict[str, dict[int, list[np.ndarray]]]:
    """Claims, fetches and steps `ctx` once; before the step, every page it holds in each
    group gets random bits (the model's keys and values, or latents, and their scales).
    Returns, per group name, each page index's bits, leaf by leaf."""
    m.external_claim(ctx.request_id)
    m.fetch([ctx])
    rng = np.random.default_rng(seed)
    written: dict[str, dict[int, list[np.ndarray]]] = {}
    for group in m.replicas[0].groups:
        first, pages = m.get_req_blocks_per_group(ctx.request_id)[group.name]
        written[group.name] = {}
        for idx, page in enumerate(pages, start=first):
            written[group.name][idx] = []
            for view in leaves(group):
                bits = np.iinfo(view.dtype).max
                view[page] = rng.integers(0, bits, view[page].shape, view.dtype, endpoint=True)
                written[group.name][idx].append(view[page].copy())
    ctx.update(1)
    m.step([ctx])
    return written


def evict_from_devices(m, hashes: list[int]) -> None:
    """Requests of other tokens as long as the device memory (`make(num_pages=8)`),
    each released, until no group's pool holds `hashes`."""
    pools = [g.pool for g in m.replicas[0].groups]
    for i in range(3):
        if not any(set(hashes) & pool.indexed_hashes() for pool in pools):
            return
        serve_filled(m, TextContext(np.arange(31) + 1000 * (i + 1), f"X{i}"), seed=100 + i)
        m.release(f"X{i}")
    assert not any(set(hashes) & pool.indexed_hashes() for pool in pools)


def loads_by_group(m, request_id: str) -> dict[int, list[int]]:
    """Group index -> the hashes of the request's pending tier loads."""
    out: dict[int, list[int]] = {}
    for load in m.replicas[0]._request(request_id).loads:
        out.setdefault(load.group, []).append(load.hit.page_hash)
    return out


def check_loaded(m, request_id: str, written, needed: dict[str, range]) -> None:
    """The request's pages `needed[group]` hold, bit for bit, what was `written` there."""
    rows = m.get_req_blocks_per_group(request_id)
    for group in m.replicas[0].groups:
        first, pages = rows[group.name]
        for idx in needed[group.name]:
            for view, bits in zip(leaves(group), written[group.name][idx], strict=True):
                np.testing.assert_array_equal(view[pages[idx - first]], bits)


@pytest.mark.parametrize("kind", ["full", "mla"])
def test_each_group_offloads_to_its_host_tier_and_loads_only_what_it_needs(session, kind):
    m = make(session, kind, host_config(), num_pages=8)
    r = m.replicas[0]
    other = "latent" if kind == "mla" else "full"
    hosts = [stack.named("host") for stack in r.group_tiers]
    # Each group's host tier has its share of the memory (in proportion to its bytes
    # per page: as many pages as the others), in its own page layout: the sliding
    # group's pages hold K and V of 2 heads of 8, the other group's K and V of one head
    # of 16, or one latent row of 24.
    shape_bytes = {"sliding": 2 * 4 * 2 * 8 * 4, "full": 2 * 4 * 16 * 4, "latent": 4 * 24 * 4}
    total = sum(shape_bytes[g.name] for g in r.groups)
    for group, host in zip(r.groups, hosts):
        assert host.pages.bytes_per_page == shape_bytes[group.name]
        share = HOST_BYTES / 2**30 * shape_bytes[group.name] / total
        assert host.pool.num_pages == int(share * 2**30) // shape_bytes[group.name]
    written = serve_filled(m, TextContext(np.arange(17), "A"), seed=1)
    hashes = r.committed_hashes("A")
    assert len(hashes) == 4
    for host in hosts:  # both groups committed pages 0-3 (before the window slid)
        assert host.pool.indexed_hashes() == set(hashes)
    m.release("A")
    evict_from_devices(m, hashes)
    b = TextContext(np.r_[np.arange(16), [99, 98]], "B")
    m.external_claim("B")
    assert m.maybe_reserve(b) and b.start_idx == 16
    # The full (or MLA) group loads all 4 pages, the window only the 2 it reads.
    assert loads_by_group(m, "B") == {0: hashes[2:], 1: hashes}
    assert sum(hosts[0].pinned.values()) == 2 and sum(hosts[1].pinned.values()) == 4
    m.fetch([b])
    assert not r.pending_loads("B") and not hosts[0].pinned and not hosts[1].pinned
    check_loaded(m, "B", written, {"sliding": range(2, 4), other: range(4)})
    metrics = m.metrics
    assert metrics.cache_tokens == metrics.host_cache_tokens == 16
    assert metrics.device_cache_tokens == 0
    assert metrics.bytes_from_host == 2 * shape_bytes["sliding"] + 4 * shape_bytes[other]
    # The loaded pages are indexed on each group's device: the next request hits there.
    c = TextContext(np.r_[np.arange(16), [7]], "C")
    m.external_claim("C")
    assert m.maybe_reserve(c) and c.start_idx == 16 and not r.pending_loads("C")
    assert m.metrics.device_cache_tokens == 16
    m.check_invariants()


def test_one_group_loads_from_its_host_tier_beside_the_others_device_hits(session):
    """Requests of other tokens take one group's memory (the shared budget moves it to
    the group under pressure, evicting that group's cached pages) while the other keeps
    the pages a hit needs there: the joint hit is the whole prefix, where the devices
    alone serve none of it, so its tokens count as the host tier's (vLLM counts a
    connector's the same); only the group that lost its pages loads them."""
    m = make(session, "full", host_config())
    r = m.replicas[0]
    written = serve_filled(m, TextContext(np.arange(17), "A"), seed=1)
    hashes = r.committed_hashes("A")
    m.release("A")
    needed = {"sliding": hashes[2:], "full": hashes}  # the window reads 2 pages
    for i in range(4):
        missing = {g.name: [h for h in needed[g.name] if h not in g.pool.indexed_hashes()]
                   for g in r.groups}
        if any(missing.values()):
            break
        serve_filled(m, TextContext(np.arange(31) + 1000 * (i + 1), f"X{i}"), seed=10 + i)
        m.release(f"X{i}")
    lost = [g for g in r.groups if missing[g.name]]
    assert len(lost) == 1 and missing[lost[0].name] == needed[lost[0].name]
    b = TextContext(np.r_[np.arange(16), [99]], "B")
    m.external_claim("B")
    assert m.maybe_reserve(b) and b.start_idx == 16
    assert loads_by_group(m, "B") == {lost[0].index: needed[lost[0].name]}
    m.fetch([b])
    check_loaded(m, "B", written, {"sliding": range(2, 4), "full": range(4)})
    metrics = m.metrics
    assert metrics.cache_tokens == metrics.host_cache_tokens == 16
    page_bytes = r.group_tiers[lost[0].index].named("host").pages.bytes_per_page
    assert metrics.bytes_from_host == len(needed[lost[0].name]) * page_bytes
    m.check_invariants()


def test_a_refused_reservation_changes_no_groups_tier(session):
    """A joint tier hit that does not fit pins nothing and takes nothing in any group."""
    m = make(session, "full", host_config(), num_pages=8)
    r = m.replicas[0]
    serve_filled(m, TextContext(np.arange(17), "A"), seed=1)
    hashes = r.committed_hashes("A")
    m.release("A")
    evict_from_devices(m, hashes)
    hogs = []
    for i in range(3):  # the full group's pool can take fewer pages than B needs
        hog = TextContext(np.arange(23) + 5000 * (i + 1), f"H{i}")
        m.external_claim(hog.request_id)
        if m.maybe_reserve(hog):
            hogs.append(hog)
    b = TextContext(np.r_[np.arange(16), np.arange(50, 64)], "B")  # 4 hits + 4 pages
    m.external_claim("B")
    hosts = [stack.named("host") for stack in r.group_tiers]
    before = (m.group_page_counts(0), [h.pinned for h in hosts],
              [h.pool.indexed_hashes() for h in hosts], b.start_idx)
    assert not m.maybe_reserve(b)
    assert (m.group_page_counts(0), [h.pinned for h in hosts],
            [h.pool.indexed_hashes() for h in hosts], b.start_idx) == before
    for hog in hogs:
        m.release(hog.request_id)
    assert m.maybe_reserve(b) and b.start_idx == 16
    m.check_invariants()


@pytest.mark.parametrize("kind", ["full", "mla"])
def test_the_shared_tier_keys_name_each_group_and_round_trip_its_pages(
        session, redis_server, kind):
    ns = fresh_namespace()
    config = mokv.RemoteTierConfig(url=redis_server.url, namespace=ns)
    a = make(session, kind, config)
    written = serve_filled(a, TextContext(np.arange(17), "A"), seed=1)
    for stack in a.replicas[0].group_tiers:
        for store in stack.named("remote").stores:
            assert store.flush(10)
    keys = redis_server.client().keys(f"mokv:v4:{ns}:*")
    other = ("l1.h1.d24.tp0-1.mla-g1" if kind == "mla" else "l1.h1.d16.tp0-1.full-g1")
    assert Counter(key.decode().split(":")[3] for key in keys) == {
        "float32.p4.l1.h2.d8.tp0-1.sliding_window-w6-g0.xxh3": 4,
        f"float32.p4.{other}.xxh3": 4,
    }
    b = make(session, kind, config)
    ctx = TextContext(np.r_[np.arange(16), [5, 6]], "B")
    b.external_claim("B")
    assert b.maybe_reserve(ctx) and ctx.start_idx == 16
    hashes = a.replicas[0].committed_hashes("A")
    assert loads_by_group(b, "B") == {0: hashes[2:], 1: hashes}
    b.fetch([ctx])
    check_loaded(b, "B", written, {"sliding": range(2, 4),
                                   "latent" if kind == "mla" else "full": range(4)})
    metrics = b.metrics
    assert metrics.cache_tokens == metrics.remote_cache_tokens == 16
    # the window asked for its last 2 pages only, the full group for all 4
    assert b.remote_metrics.hits == 2 + 4 and b.remote_metrics.errors == 0
    b.check_invariants()
    a.close()
    b.close()


@pytest.mark.parametrize("tier", ["host", "remote"])
def test_scaled_fp8_pages_of_each_group_carry_their_scales_through_its_tiers(
        session, redis_server, tier):
    """Scaled FP8 pages (a float32 scale per 4 values) in a cache of groups: each group's
    tiers store its pages' scales with their values (the shared tier's keys name the
    format), and a joint hit loads both back, bit for bit, into other device pages."""
    from max.dtype import DType

    fp8 = dict(dtype=DType.float8_e4m3fn, quantization=mokv.KVCacheQuantization(granularity=4))
    config = (host_config() if tier == "host" else
              mokv.RemoteTierConfig(url=redis_server.url, namespace=fresh_namespace()))
    a = make(session, "full", config, num_pages=8, **fp8)
    written = serve_filled(a, TextContext(np.arange(17), "A"), seed=1)
    hashes = a.replicas[0].committed_hashes("A")
    if tier == "host":
        a.release("A")
        evict_from_devices(a, hashes)
        b = a
    else:
        for stack in a.replicas[0].group_tiers:
            for store in stack.named("remote").stores:
                assert store.flush(10)
        keys = redis_server.client().keys(f"mokv:v4:{config.namespace}:*")
        assert {key.decode().split(":")[3] for key in keys} == {
            "float8_e4m3fn.p4.l1.h2.d8.s2f32.tp0-1.sliding_window-w6-g0.xxh3",
            "float8_e4m3fn.p4.l1.h1.d16.s4f32.tp0-1.full-g1.xxh3",
        }
        b = make(session, "full", config, num_pages=8, **fp8)
    ctx = TextContext(np.r_[np.arange(16), [5, 6]], "B")
    b.external_claim("B")
    assert b.maybe_reserve(ctx) and ctx.start_idx == 16
    assert loads_by_group(b, "B") == {0: hashes[2:], 1: hashes}
    b.fetch([ctx])
    check_loaded(b, "B", written, {"sliding": range(2, 4), "full": range(4)})
    b.check_invariants()
    a.close()
    b.close()
