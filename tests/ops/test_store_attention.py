"""store_kv then flash_attention, against numpy: positions, layers, pages, GQA, dtypes."""

from __future__ import annotations

import numpy as np
import pytest
from max.dtype import DType

from .conftest import (
    LAYER,
    Config,
    buffer,
    make_cache,
    plan_graphs,
    ref_attention,
    row_offsets,
    storage,
    values,
)

PAGED_F32_GQA4 = Config("paged", DType.float32, n_kv_heads=2, head_dim=64, group=4, page_size=16)
PAGED_BF16_GQA8 = Config("paged", DType.bfloat16, n_kv_heads=1, head_dim=128, group=8, page_size=8)
PAGED_BF16_GQA8_P32 = Config("paged", DType.bfloat16, n_kv_heads=2, head_dim=128, group=8, page_size=32)
CONT_F32_MHA = Config("continuous", DType.float32, n_kv_heads=4, head_dim=128, group=1)
PAGED_BF16_GQA1 = Config("paged", DType.bfloat16, n_kv_heads=4, head_dim=128, group=1)
PAGED_BF16_GQA4 = Config("paged", DType.bfloat16, n_kv_heads=2, head_dim=128, group=4)
PAGED_F32_GQA8 = Config("paged", DType.float32, n_kv_heads=5, head_dim=128, group=8)
PAGED_F32_MHA20 = Config("paged", DType.float32, n_kv_heads=20, head_dim=64, group=1)

TOL = {DType.float32: 2e-5, DType.bfloat16: 2e-2}

EACH_PATH = [PAGED_F32_GQA4, PAGED_BF16_GQA1, PAGED_BF16_GQA4, PAGED_BF16_GQA8, PAGED_BF16_GQA8_P32,
             PAGED_F32_GQA8, PAGED_F32_MHA20]  # the tests that take `compiled_each_path`
plan_graphs("store_attention", EACH_PATH, paths=("native", "portable"))
plan_graphs("store_attention", [CONT_F32_MHA])


def run_store_attention(
    compiled, cfg, cache_lengths, new_tokens, seed=0, share=0, q_std=1.0, rise=0.0,
    unread=np.nan,
):
    """Runs the graph on a random batch; returns (cache before, cache after, k, v, q, out).
    Scores have standard deviation `q_std` (K and Q entries are standard normal). With
    `rise`, cached key j of c gets rise * j / c added to every element and the queries
    0.5, so scores climb along the context by about rise * 0.5 * sqrt(head_dim). With a
    window (`cfg.window`), the keys and values before each sequence's first window are
    `unread`: NaN, which poisons the output if the kernel reads them, masked or not;
    MAX's kernels read and mask them, so they get a finite value that would dominate
    the softmax unless masked."""
    rng = np.random.default_rng(seed)
    cache = make_cache(cfg.params, cache_lengths, new_tokens, rng, share_prefix_pages=share)
    if rise:
        for b, c in enumerate(cache_lengths):
            ramp = rise * np.arange(c, dtype=np.float32)[:, None, None] / c
            cache.write(b, LAYER, 0, 0, cache.rows(b, LAYER, 0, 0, c) + ramp)
    for b, c in enumerate(cache_lengths if cfg.window else []):
        before_window = max(0, c - cfg.window + 1)  # positions before the first new token's window
        for kv in (0, 1):
            cache.write(b, LAYER, kv, 0, np.full((before_window, cfg.n_kv_heads, cfg.head_dim),
                                                  unread, np.float32))
    before = cache.blocks.copy()
    total = sum(new_tokens)
    h, d = cfg.n_kv_heads, cfg.head_dim
    k = storage(rng.standard_normal((total, h, d)).astype(np.float32), cfg.dtype)
    v = storage(rng.standard_normal((total, h, d)).astype(np.float32), cfg.dtype)
    q = q_std * rng.standard_normal((total, cfg.n_q, d)) + (0.5 if rise else 0.0)
    q = storage(q.astype(np.float32), cfg.dtype)
    offsets = row_offsets(new_tokens)
    model = compiled("store_attention", cfg)
    (out,) = model.execute(
        *cache.buffers(), buffer(k, cfg.dtype), buffer(v, cfg.dtype), buffer(q, cfg.dtype), buffer(offsets)
    )
    # numpy has no bf16: read the output's bits as uint16.
    out = out.view(DType.uint16) if cfg.dtype == DType.bfloat16 else out
    return cache, before, k, v, q, offsets, out.to_numpy()


def check(cfg, cache, before, k, v, q, offsets, out, tol=None):
    # 1. Every new token landed at cache_lengths[b] + i, in K and V of LAYER only.
    for b in range(len(offsets) - 1):
        c, lo, hi = int(cache.cache_lengths[b]), int(offsets[b]), int(offsets[b + 1])
        np.testing.assert_array_equal(cache.rows(b, LAYER, 0, c, c + hi - lo), values(k[lo:hi], cfg.dtype))
        np.testing.assert_array_equal(cache.rows(b, LAYER, 1, c, c + hi - lo), values(v[lo:hi], cfg.dtype))
    np.testing.assert_array_equal(cache.blocks[:, :, 0], before[:, :, 0])  # layer 0 untouched
    # 2. Nothing else changed: restore the written rows' old bytes and compare.
    bits = f"u{before.itemsize}"  # compared as bits: a window's NaN rows equal themselves
    changed = (cache.blocks.view(bits) != before.view(bits)).any(axis=(-1, -2))
    assert changed.sum() <= 2 * int(offsets[-1]), "store_kv wrote outside the new tokens' rows"
    # 3. Attention over prefix + new tokens (a window's keys only).
    scale = 1.0 / np.sqrt(cfg.head_dim)
    ref = ref_attention(values(q, cfg.dtype), cache, offsets, LAYER, scale, window=cfg.window,
                        sinks=cfg.sink_logits)
    tol = tol or TOL[cfg.dtype]
    np.testing.assert_allclose(values(out, cfg.dtype), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "cache_lengths,new_tokens",
    [
        # decode | prefill crossing pages | prefill after a cached prefix |
        # decode opening a new page
        ([20, 0, 30, 16], [1, 35, 5, 1]),
        # decode only, a different batch size through the same compiled graph
        ([5, 47, 63], [1, 1, 1]),
        # one long prefill: several 64-key tiles and masked-out tiles skipped
        ([0], [90]),
        # few units, long contexts: keys split across cores, partial softmax states merged
        ([1500, 700], [1, 3]),
        # a prefill chunk after a long cached prefix: split tiles, masked diagonal in the last split
        ([600], [40]),
        # two-token chunks: 8 rows per head (8-lane key-major scores), the diagonal masked per row
        ([600, 33], [2, 2]),
    ],
)
def test_paged_f32_gqa4(compiled_each_path, cache_lengths, new_tokens):
    cache, before, k, v, q, offsets, out = run_store_attention(compiled_each_path, PAGED_F32_GQA4, cache_lengths, new_tokens)
    check(PAGED_F32_GQA4, cache, before, k, v, q, offsets, out)


def test_paged_shared_prefix_pages(compiled):
    """Sequences 0 and 1 share their first two pages (32 tokens); each appends its own."""
    cache, before, k, v, q, offsets, out = run_store_attention(
        compiled, PAGED_F32_GQA4, [40, 36], [1, 3], seed=3, share=2
    )
    np.testing.assert_array_equal(cache.lookup_table[0, :2], cache.lookup_table[1, :2])
    np.testing.assert_array_equal(cache.rows(0, LAYER, 0, 0, 32), cache.rows(1, LAYER, 0, 0, 32))
    check(PAGED_F32_GQA4, cache, before, k, v, q, offsets, out)


def test_paged_bf16_gqa8_head128(compiled):
    """bf16 cache, 8 query heads per KV head, pages of 8 tokens."""
    cache, before, k, v, q, offsets, out = run_store_attention(
        compiled, PAGED_BF16_GQA8, [9, 0, 24], [1, 20, 3], seed=1
    )
    check(PAGED_BF16_GQA8, cache, before, k, v, q, offsets, out)


@pytest.mark.parametrize(
    "cfg",
    [PAGED_BF16_GQA1, PAGED_BF16_GQA4, PAGED_BF16_GQA8, PAGED_BF16_GQA8_P32],
    ids=["gqa1", "gqa4", "gqa8", "gqa8-page32"],
)
def test_paged_bf16_long_decode(compiled_each_path, cfg):
    """bf16 decode over 1000+ keys (many pages and key tiles, keys split across cores),
    the path that takes bf16 dot products on CPUs with AVX-512 BF16 (Q and P rounded to
    bf16). Scores with a standard deviation of 2 make the softmax peaky, so a wrong
    score shows. GQA 8 over 8-token pages takes partial 8-row key blocks only; over
    32-token pages, full 16-key blocks (V prefetched inside the score loop)."""
    cache, before, k, v, q, offsets, out = run_store_attention(
        compiled_each_path, cfg, [1300, 1100, 2], [1, 1, 1], seed=4, q_std=2.0
    )
    check(cfg, cache, before, k, v, q, offsets, out)


@pytest.mark.parametrize(
    "cfg,cache_lengths,new_tokens",
    [(PAGED_BF16_GQA8_P32, [1300, 900], [1, 1]), (PAGED_F32_GQA4, [600, 300], [40, 1])],
    ids=["bf16-gqa8-decode", "f32-gqa4-prefill"],
)
def test_rising_scores(compiled_each_path, cfg, cache_lengths, new_tokens):
    """Scores that climb ~30-45 (natural units) along the context: the softmax reference
    is raised lazily (only past 8 in log2 units) again and again within each split, so
    a rescale of O or l that is skipped, doubled or taken against the wrong reference
    shows; P stays bounded (no overflow to inf in f32 or bf16)."""
    cache, before, k, v, q, offsets, out = run_store_attention(
        compiled_each_path, cfg, cache_lengths, new_tokens, seed=7, rise=8.0
    )
    check(cfg, cache, before, k, v, q, offsets, out)


def test_paged_f32_gqa8_odd_heads(compiled_each_path):
    """f32 GQA 8 decode: 8-lane key-major scores with K broadcast from the cache. Five KV
    heads make key rows 2.5 KiB apart (8-key blocks) and a unit of 40 rows, so the
    16-row softmax has padding lanes; the long contexts are split across cores and
    merged; the 2-token entry takes the 16-row path."""
    cache, before, k, v, q, offsets, out = run_store_attention(
        compiled_each_path, PAGED_F32_GQA8, [1300, 40, 5], [1, 1, 2], seed=5, q_std=2.0
    )
    check(PAGED_F32_GQA8, cache, before, k, v, q, offsets, out)


def test_paged_f32_mha_20_heads(compiled_each_path):
    """GQA 1 decode scores one key x 16 heads per butterfly: 20 KV heads make two head
    blocks, the second with 12 lanes repeating head 19 (padding rows of the softmax);
    the long context is split across cores and merged; the 3-token entry takes 4-row
    blocks (3 rows and a padding row per head) with key-major scores."""
    cache, before, k, v, q, offsets, out = run_store_attention(
        compiled_each_path, PAGED_F32_MHA20, [700, 9, 50], [1, 1, 3], seed=6, q_std=2.0
    )
    check(PAGED_F32_MHA20, cache, before, k, v, q, offsets, out)


def test_continuous_f32_mha_head128(compiled):
    """Continuous slots (shuffled), plain multi-head attention."""
    cache, before, k, v, q, offsets, out = run_store_attention(
        compiled, CONT_F32_MHA, [0, 17, 70], [12, 1, 4], seed=2
    )
    check(CONT_F32_MHA, cache, before, k, v, q, offsets, out)
