"""An MLA cache group (`CacheGroupConfig(latent_dim=, rope_dim=)`): pages of one latent per
token and layer, whole on every tensor-parallel device; prefix hits, the host tier and
events exactly as a full group's; sizing that counts the latent once per device."""

from __future__ import annotations

import mokv
import numpy as np
import pytest
from max.dtype import DType
from mokv import CacheGroupConfig, TextContext
from mokv.cache import page_copy
from mokv.managers.paged.groups import LatentGroup
from mokv.managers.paged.sizing import infer_optimal_batch_size

from ..conftest import LATENT, NUM_LAYERS, ROPE, make_paged, mla


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(window_size=8), "an MLA group reads every token before it; window_size=8"),
        (dict(n_kv_heads=2), "one latent per token, not n_kv_heads=2 heads"),
        (dict(head_dim=20), "head_dim is latent_dim \\+ rope_dim = 24, got head_dim=20"),
        (dict(rope_dim=None), "names both latent_dim and rope_dim, got latent_dim=16"),
        (dict(latent_dim=0), "latent_dim must be a positive int or None, got 0"),
    ],
)
def test_an_mla_group_refuses_what_it_cannot_honour(fields, message):
    config = dict(name="mla", num_layers=2, latent_dim=LATENT, rope_dim=ROPE) | fields
    with pytest.raises(ValueError, match=message):
        CacheGroupConfig(**config)


def test_a_cache_of_one_mla_group_holds_one_latent_head():
    group = CacheGroupConfig("mla", NUM_LAYERS, latent_dim=LATENT, rope_dim=ROPE)
    with pytest.raises(ValueError, match="n_kv_heads must be 1 and head_dim 24, got n_kv_heads=2"):
        mokv.KVCacheParams(DType.float32, n_kv_heads=2, head_dim=24, groups=(group,))
    # The heads are not split: one latent head on three devices is a valid replica.
    params = mokv.KVCacheParams(DType.float32, 1, 24, page_size=4, n_devices=3, groups=(group,))
    assert (params.kv_dim, params.n_kv_heads_per_device, params.is_hybrid) == (1, 1, False)
    # once per device: 2 layers * 24 values * 4 bytes on each of 3 devices
    assert params.bytes_per_token(NUM_LAYERS) == 2 * 24 * 4 * 3
    gqa = mokv.KVCacheParams(DType.float32, n_kv_heads=3, head_dim=24, n_devices=3)
    assert gqa.bytes_per_token(NUM_LAYERS) == 2 * 2 * 3 * 24 * 4  # K and V, heads split


def test_every_tp_device_holds_the_whole_latent_and_sizing_counts_it_per_device(session):
    m = make_paged(session, num_pages=6, max_seq_len=16, **mla(n_devices=2))
    replica = m.replicas[0]
    (group,) = replica.groups
    assert isinstance(group, LatentGroup) and (group.latent_dim, group.rope_dim) == (16, 8)
    shape = (6, 1, NUM_LAYERS, 4, 1, LATENT + ROPE)
    assert [tuple(b.shape) for b in replica.blocks] == [shape, shape]
    assert m.total_num_pages == 6
    page_bytes = 4 * NUM_LAYERS * (LATENT + ROPE) * 4 * 2  # page_size * row bytes * devices
    assert m.params.bytes_per_page(NUM_LAYERS) == page_bytes
    assert infer_optimal_batch_size(m.params, 8, NUM_LAYERS, 6 * page_bytes) == 3
    symbols = m.input_symbols()[0]
    assert [str(d) for d in symbols[0].shape][1:] == ["1", "2", "4", "1", "24"]


def test_a_prefix_hit_shares_the_latent_pages(session):
    m = make_paged(session, num_pages=8, **mla())
    view = page_copy.numpy_view(m.replicas[0].blocks[0])
    a = TextContext(np.arange(9), "A")
    m.external_claim("A")
    m.fetch([a])
    pages = m.get_req_blocks("A")[:2]
    view[pages] = np.arange(view[pages].size, dtype=view.dtype).reshape(view[pages].shape)
    written = view[pages].copy()
    a.update(1)
    m.step([a])
    m.release("A")
    b = TextContext(np.r_[np.arange(8), [7, 7]], "B")
    m.external_claim("B")
    assert m.maybe_reserve(b) and b.start_idx == 8
    assert m.get_req_blocks("B")[:2] == pages
    np.testing.assert_array_equal(view[pages], written)
    m.release("B")
    m.check_invariants()
