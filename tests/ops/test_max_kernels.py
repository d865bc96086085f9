"""MAX's attention kernel on mokv's caches, through the view a GPU uses
(kernels/max_kernels.mojo), run on the CPU against the same numpy references as
mokv's own kernel: the paged view (its padded lookup table, max lengths), the
continuous view (its slot count, bounds from the batch), prefill, decode and split
keys. A GPU runs the same code with MAX's GPU kernels (tests/ops/test_on_gpu.py)."""

from __future__ import annotations

import dataclasses

import pytest

from . import test_store_attention as cpu_tests  # a module: its tests are not collected twice
from . import test_window_attention
from .conftest import plan_graphs
from .test_store_attention import (
    CONT_F32_MHA,
    PAGED_BF16_GQA8_P32,
    PAGED_F32_GQA4,
    check,
    run_store_attention,
)

# MAX 26.7's CPU kernel compiles its sliding-window mask only for windows of at least
# 128 keys ("SIMD width of sliding window mask must be <= window size": it masks 128
# scores at a time); 37 fails to compile. 130 starts mid-page (pages of 16).
F32_GQA4_WINDOW = dataclasses.replace(PAGED_F32_GQA4, window=130)
plan_graphs("store_attention", [PAGED_F32_GQA4, PAGED_BF16_GQA8_P32, CONT_F32_MHA, F32_GQA4_WINDOW],
            paths=("max-kernels",))


@pytest.mark.parametrize(
    "cache_lengths,new_tokens",
    [([20, 0, 30, 16], [1, 35, 5, 1]), ([1500, 700], [1, 3]), ([600], [40])],
    ids=["mixed", "long-decode", "chunk-after-prefix"],
)
def test_paged_view(compiled_max_kernels, cache_lengths, new_tokens):
    cpu_tests.test_paged_f32_gqa4(compiled_max_kernels, cache_lengths, new_tokens)


def test_paged_view_bf16_gqa8(compiled_max_kernels):
    cpu_tests.test_paged_bf16_long_decode(compiled_max_kernels, PAGED_BF16_GQA8_P32)


def test_continuous_view(compiled_max_kernels):
    cache, before, k, v, q, offsets, out = run_store_attention(
        compiled_max_kernels, CONT_F32_MHA, [0, 17, 70], [12, 1, 4], seed=2
    )
    check(CONT_F32_MHA, cache, before, k, v, q, offsets, out)


@pytest.mark.parametrize("cache_lengths,new_tokens", test_window_attention.CASES[:3])
def test_paged_view_with_a_sliding_window(compiled_max_kernels, cache_lengths, new_tokens):
    """MAX's `sliding_window_causal` mask through the view. MAX's CPU kernel reads the
    keys before a window (NaN there gives NaN outputs): they hold large finite values,
    which dominate unless masked."""
    cache, before, k, v, q, offsets, out = run_store_attention(
        compiled_max_kernels, F32_GQA4_WINDOW, cache_lengths, new_tokens, seed=5, unread=40.0
    )
    check(F32_GQA4_WINDOW, cache, before, k, v, q, offsets, out)
