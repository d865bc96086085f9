"""FP8 pages in the tiers (issue 53): a scaled page's scales travel with its values, so a
page offloaded to the host tier or to the shared (Redis) tier and loaded back into other
device pages has bit-identical values AND scales, on two TP shards; unscaled FP8 pages
travel as their values alone; the shared tier's value of an FP8 page is its values (1
byte each) and its scales (4 bytes per `granularity` values), measured on the server."""

import mokv
import numpy as np
import pytest
from max.dtype import DType
from mokv import TextContext
from mokv.cache import page_copy

from ..managers.conftest import NUM_LAYERS, small_params
from .test_host import evict_from_device, make_host
from .test_remote import fresh_namespace, remote_manager, reserved, stores

# head_dim 8 in scales of 4 lanes: two float32 scales per head and token.
SCALED = dict(dtype=DType.float8_e4m3fn, quantization=mokv.KVCacheQuantization(granularity=4))
UNSCALED = dict(dtype=DType.float8_e4m3fn)
FORMATS = {"scaled": SCALED, "unscaled": UNSCALED}


def leaves(m, replica=0) -> list:
    """Aliasing numpy views of every buffer a page lives in: each shard's values, then
    each shard's scales."""
    group = m.replicas[replica].group
    return [page_copy.numpy_view(b) for b in [*group.blocks, *(group.scales or [])]]


def fill(views, pages, seed) -> list[np.ndarray]:
    """Random bits in `pages` of every view (standing in for the kernels' writes)."""
    rng = np.random.default_rng(seed)
    for view in views:
        view[pages] = rng.integers(0, np.iinfo(view.dtype).max, view[pages].shape, view.dtype)
    return [view[pages].copy() for view in views]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_host_tier_round_trip_keeps_values_and_scales_bit_exact(session, fmt):
    m = make_host(session, n_devices=2, **FORMATS[fmt])
    views = leaves(m)
    assert len(views) == (4 if fmt == "scaled" else 2)
    if fmt == "scaled":  # [pages, 2, layers, page_size, heads, 2] float32 beside the values
        assert views[2].shape[1:] == (2, NUM_LAYERS, 4, 1, 2)
    a = TextContext(np.arange(9), "A")
    m.external_claim("A")
    m.fetch([a])
    pages = m.get_req_blocks("A")[:2]
    original = fill(views, pages, seed=1)
    a.update(1)
    m.step([a])  # commits and writes pages 0-1 through to the host tier
    m.release("A")  # preempted: its pages only cached now
    evict_from_device(m)
    for view in views:
        view[:] = 0  # whatever the device held is gone
    m.fetch([reserved(m, np.r_[np.arange(8), [5]], "B")])  # A's prefix, from the host
    assert m.metrics.host_cache_tokens == 8
    # The scales counted with the values.
    assert m.metrics.bytes_from_host == 2 * m.params.bytes_per_page(NUM_LAYERS)
    loaded = m.get_req_blocks("B")[:2]
    for view, before in zip(views, original):
        np.testing.assert_array_equal(view[loaded], before)


def committed_by_a(session, server, namespace, **fields):
    """Manager A computes tokens 0-8 (two full pages of random bits, committed and sent
    to Redis). Returns A and those pages' bits, leaf by leaf."""
    a = remote_manager(session, server, namespace, **fields)
    ctx = TextContext(np.r_[np.arange(8), [9]], "A")
    a.external_claim("A")
    a.fetch([ctx])
    original = fill(leaves(a), a.get_req_blocks("A")[:2], seed=2)
    ctx.update(1)
    a.step([ctx])
    for store in stores(a):
        assert store.flush(10)
    return a, original


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_shared_tier_round_trip_keeps_values_and_scales_bit_exact(session, redis_server, fmt):
    ns = fresh_namespace()
    fields = dict(n_devices=2, **FORMATS[fmt])
    a, original = committed_by_a(session, redis_server, ns, **fields)
    assert a.remote_metrics.pages_written == 2 * 2  # two pages, one value per shard
    b = remote_manager(session, redis_server, ns, **fields)
    later = reserved(b, np.r_[np.arange(8), [5, 6]], "B")
    assert later.start_idx == 8
    b.fetch([later])
    loaded = b.get_req_blocks("B")[:2]
    for view, before in zip(leaves(b), original):
        np.testing.assert_array_equal(view[loaded], before)
    assert b.metrics.bytes_from_remote == 2 * small_params(**fields).bytes_per_page(NUM_LAYERS)
    a.close()
    b.close()


def test_fp8_and_bfloat16_pages_of_the_same_tokens_never_share(session, redis_server):
    ns = fresh_namespace()
    a, _ = committed_by_a(session, redis_server, ns, dtype=DType.bfloat16)
    for fields in FORMATS.values():
        b = remote_manager(session, redis_server, ns, **fields)
        assert reserved(b, np.r_[np.arange(8), [5]], "B").start_idx == 0
        assert b.remote_metrics.hits == 0
        b.close()
    a.close()


def test_a_stored_fp8_page_is_half_a_bfloat16_page_and_its_scales(session, redis_server):
    """Measured on the server: STRLEN of each format's values, less the value's fixed
    part (header, token ids, keys digest), which does not depend on the format."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    sizes = {}
    for name, fields in {"bf16": dict(dtype=DType.bfloat16), **FORMATS}.items():
        ns = fresh_namespace()
        a, _ = committed_by_a(session, redis_server, ns, **fields)
        keys = list(client.scan_iter(match=f"mokv:v4:{ns}:*"))
        assert len(keys) == 2
        sizes[name] = {client.strlen(k) for k in keys}.pop() - (64 + 8 * 4 + 32)
        a.close()
    # 2 x 2 layers x 4 tokens x 2 heads x 8 lanes: 2 bytes each, or 1 and a float32
    # scale per 4 lanes.
    values = 2 * NUM_LAYERS * 4 * 2 * 8
    assert sizes == {"bf16": 2 * values, "unscaled": values, "scaled": values + values}
    assert sizes["scaled"] / sizes["bf16"] == (1 + 4 / 4) / 2


def test_a_stored_page_s_key_names_its_format():
    from mokv.remote import RemoteLayout

    keys = {
        name: RemoteLayout.from_params(small_params(**fields, head_dim=128), NUM_LAYERS)
        for name, fields in {"bf16": dict(dtype=DType.bfloat16), **FORMATS}.items()
    }
    # bfloat16 keys are those before FP8 pages (the scales part only when there are some).
    assert keys["bf16"].fingerprint == "bfloat16.p4.l2.h2.d128.tp0-1.full.xxh3"
    assert keys["unscaled"].fingerprint == "float8_e4m3fn.p4.l2.h2.d128.tp0-1.full.xxh3"
    assert keys["scaled"].fingerprint == "float8_e4m3fn.p4.l2.h2.d128.s32f32.tp0-1.full.xxh3"
    values = 2 * NUM_LAYERS * 4 * 2 * 128
    assert keys["scaled"].page_nbytes == values + 4 * values // 4
    assert keys["scaled"].values_nbytes == keys["unscaled"].page_nbytes == values
    with pytest.raises(ValueError, match="scales_per_head must be an int >= 0, and 0 but for"):
        RemoteLayout(DType.bfloat16, 4, 2, 2, 128, scales_per_head=1)
