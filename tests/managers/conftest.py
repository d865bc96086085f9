"""Small managers on the CPU device: few pages, short pages, so that tests see eviction."""

import mokv
import pytest
from max.driver import CPU
from max.dtype import DType

NUM_LAYERS = 2
LATENT, ROPE = 16, 8  # an MLA group's latent and RoPE widths


def mla(**overrides) -> dict:
    """Overrides of `small_params` for a cache of one MLA group of every layer."""
    group = mokv.CacheGroupConfig("mla", NUM_LAYERS, latent_dim=LATENT, rope_dim=ROPE)
    return dict(n_kv_heads=1, head_dim=LATENT + ROPE, groups=(group,), **overrides)


def small_params(**overrides) -> mokv.KVCacheParams:
    fields = dict(dtype=DType.float32, n_kv_heads=2, head_dim=8, page_size=4,
                  enable_prefix_caching=True)
    fields.update(overrides)
    return mokv.KVCacheParams(**fields)


def make_paged(session, num_pages=16, max_batch_size=4, max_seq_len=32, checks=True, **overrides):
    """A paged manager with exactly `num_pages` pages per replica."""
    params = small_params(**overrides)
    dp = params.data_parallel_degree
    return mokv.PagedKVCacheManager(
        params,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        num_layers=NUM_LAYERS,
        devices=[CPU()] * params.n_devices,
        session=session,
        available_cache_memory=dp * num_pages * params.bytes_per_page(NUM_LAYERS),
        page_size=params.page_size,
        enable_runtime_checks=checks,
    )


@pytest.fixture
def paged(session):
    return make_paged(session)
