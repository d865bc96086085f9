"""Fixtures of the model tests: small configs, fresh managers, compiled decoders.

`mokv_graphs` is the repository's graphs/ directory, installed by pyproject.toml.
Compiling a decoder graph takes 10-20 s on this machine, so each cache kind's model is
built once per test session and shared; tests give it fresh managers' worth of
requests and release them afterwards.
"""

from __future__ import annotations

import mokv
import mokv_graphs as mg
import pytest
from max.driver import CPU

CONFIG = mg.DecoderConfig(
    vocab_size=128, hidden_size=64, num_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
    intermediate_size=128, max_seq_len=512,
)
"""A smaller decoder than the default: same code paths, faster numpy reference. Its RoPE
table covers the longest sequence of examples/generate.py, which the example test runs on
a checkpoint of this config: the example then loads the paged model's compiled graph from
MAX's cache instead of compiling the default decoder's (positions below 256 have the
same table rows at any length, so nothing else changes)."""

PAGE_SIZE = 8
MAX_BATCH_SIZE = 6
NUM_PAGES = 48
MAX_SEQ_LEN = 96
"""Managers hold shorter sequences than the model's RoPE table: 12 pages of 8 tokens."""


@pytest.fixture(scope="session")
def config():
    return CONFIG


@pytest.fixture(scope="session")
def weights():
    return mg.init_weights(CONFIG, seed=1)


def make_manager(session, strategy: str, num_pages: int = NUM_PAGES, prefix_caching: bool = True):
    """A fresh manager for CONFIG: `num_pages` pages (paged) or MAX_BATCH_SIZE slots."""
    params = CONFIG.kv_params(strategy, page_size=PAGE_SIZE, enable_prefix_caching=prefix_caching)
    return mokv.load_kv_manager(
        params,
        max_batch_size=MAX_BATCH_SIZE,
        max_seq_len=MAX_SEQ_LEN,
        num_layers=CONFIG.num_layers,
        devices=[CPU()],
        session=session,
        available_cache_memory=num_pages * params.bytes_per_page(CONFIG.num_layers),
        page_size=PAGE_SIZE,
        enable_runtime_checks=True,
    )


@pytest.fixture
def make_kv_manager(session):
    """`make_kv_manager(strategy, num_pages=..., prefix_caching=...)` -> a fresh manager."""
    return lambda strategy, **kwargs: make_manager(session, strategy, **kwargs)


def _model(session, weights, strategy):
    """One compiled decoder per cache kind; `model.manager` is swapped per test."""
    return mg.DecoderModel(CONFIG, make_manager(session, strategy), session, weights)


@pytest.fixture(scope="session")
def paged_model(session, weights):
    return _model(session, weights, "paged")


@pytest.fixture(scope="session")
def continuous_model(session, weights):
    return _model(session, weights, "continuous")
