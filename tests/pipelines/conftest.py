"""MAX 26.7's own params and contexts for the tests of `mokv.pipelines`."""

from __future__ import annotations

import numpy as np
import pytest
from max.dtype import DType
from max.graph import DeviceRef
from max.nn.kv_cache import MHAKVCacheParams
from max.pipelines.context import TextContext, TokenBuffer

PAGE_SIZE = 128  # MAX's pipelines take multiples of 128
NUM_PAGES = 9
PAGE_BYTES = 2 * 2 * PAGE_SIZE * 2 * 16 * 4  # K and V, 2 layers, 2 heads of 16 floats
SYSTEM = [int(t) for t in np.random.default_rng(1).integers(3, 256, 140)]
"""A shared prompt prefix one page and 12 tokens long."""


BASE_FIELDS = dict(
    dtype=DType.float32,
    num_layers=2,
    devices=[DeviceRef.CPU()],
    page_size=PAGE_SIZE,
    enable_prefix_caching=True,
)
"""MAX's params fields every test cache here shares (float32, 2 layers, on the CPU)."""


def max_params(**fields) -> MHAKVCacheParams:
    """MAX's params of a small float32 cache on the CPU (the tiny Llama's shape)."""
    return MHAKVCacheParams(**(BASE_FIELDS | {"head_dim": 16, "n_kv_heads": 2} | fields))


def loader_args(session, **params_fields) -> dict:
    """The arguments MAX's pipeline passes `load_kv_manager`, for `NUM_PAGES` pages."""
    return dict(
        params=max_params(**params_fields),
        max_batch_size=2,
        max_seq_len=512,
        session=session,
        available_cache_memory=NUM_PAGES * PAGE_BYTES,
        is_di_enabled=False,
        model_name="base",
        max_num_input_tokens=None,
    )


def max_context(tail, **fields) -> TextContext:
    """MAX's request context of `SYSTEM + tail`."""
    tokens = np.array(SYSTEM + list(tail), np.int64)
    return TextContext(max_length=512, tokens=TokenBuffer(tokens), **fields)


@pytest.fixture
def max_own(session):
    """MAX 26.7's own manager for the same cache (its Jenga manager on the CPU)."""
    from max.pipelines.kv_cache import load_kv_manager

    manager = load_kv_manager(**loader_args(session))
    yield manager
    manager.shutdown()


@pytest.fixture
def ours(session):
    from mokv.pipelines import load_kv_manager

    manager = load_kv_manager(**loader_args(session))
    yield manager
    manager.shutdown()
