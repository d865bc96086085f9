"""flash_attention with a sliding window and attention sinks, against numpy, on both
kinds of CPU path: a window that starts mid-page, decode far past many windows, prefill
longer than the window, a chunk after a long cache, keys split across cores, every
decode form, sinks with and without a window. The
keys and values before each sequence's first window are NaN (`run_store_attention`):
the kernel reads no key there, so a sliding-window group's released pages (the pad
page in its table) can never reach an output."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from max.dtype import DType
from max.graph import DeviceRef, Graph, ops
from mokv.ops import flash_attention, kernels_path

from .conftest import cache_symbols, fetch, plan_graphs
from .test_store_attention import (
    PAGED_BF16_GQA1,
    PAGED_BF16_GQA4,
    PAGED_BF16_GQA8,
    PAGED_F32_GQA4,
    PAGED_F32_GQA8,
    check,
    run_store_attention,
)

F32_GQA4 = dataclasses.replace(PAGED_F32_GQA4, window=21)  # pages of 16: starts mid-page
BF16_GQA8 = dataclasses.replace(PAGED_BF16_GQA8, window=13)  # pages of 8
BF16_GQA1 = dataclasses.replace(PAGED_BF16_GQA1, window=100)
BF16_GQA4 = dataclasses.replace(PAGED_BF16_GQA4, window=64)
F32_GQA8 = dataclasses.replace(PAGED_F32_GQA8, window=300)
# Attention sinks (GPT-OSS: GQA 8, a window of 128 on every other layer, sinks on all):
# with a window, and without one, where long contexts split the keys (the merge adds
# the sink once).
F32_GQA8_SINKS = dataclasses.replace(PAGED_F32_GQA8, window=128, sinks=True)
BF16_GQA4_SINKS = dataclasses.replace(PAGED_BF16_GQA4, sinks=True)
WINDOWED = [F32_GQA4, BF16_GQA8, BF16_GQA1, BF16_GQA4, F32_GQA8, F32_GQA8_SINKS, BF16_GQA4_SINKS]
plan_graphs("store_attention", WINDOWED, paths=("native", "portable"))

CASES = [
    # decode far past the window | prefill past the window | a chunk after a long cache
    # | decode just inside the window
    ([1500, 0, 600, 10], [1, 90, 40, 1]),
    # decode only, windows starting at every offset in a page
    ([37, 38, 39, 40, 41], [1, 1, 1, 1, 1]),
    # two-token chunks (8 rows per head), one long prefill crossing several windows
    ([700, 33, 0], [2, 2, 130]),
    # few units, long contexts: with a wide window the keys are split across cores
    ([3000, 2500], [1, 3]),
]


@pytest.mark.parametrize(
    "cfg", WINDOWED, ids=lambda c: f"{c.dtype.name}-g{c.group}-w{c.window}{'-sinks' * c.sinks}"
)
@pytest.mark.parametrize("cache_lengths,new_tokens", CASES)
def test_a_window_reads_only_its_keys(compiled_each_path, cfg, cache_lengths, new_tokens):
    cache, before, k, v, q, offsets, out = run_store_attention(
        compiled_each_path, cfg, cache_lengths, new_tokens, seed=len(cache_lengths)
    )
    check(cfg, cache, before, k, v, q, offsets, out)


BAD_WINDOWS = [0, -3, 2.5, True, "64"]
BAD_SINKS = [  # shape, dtype, error, message
    ((7,), DType.float32, ValueError, "sinks dim 0 must be 8"),
    ((8, 1), DType.float32, ValueError, "sinks must have rank 1"),
    ((8,), DType.int32, TypeError, "sinks must have dtype float32"),
]


@pytest.mark.parametrize("case", BAD_WINDOWS + BAD_SINKS, ids=str)
def test_a_bad_window_or_sinks_is_refused_by_name(case):
    """Refused while the graph is built, naming the argument and its value."""
    cfg = F32_GQA4
    cpu = DeviceRef.CPU()
    with Graph("bad_arguments", input_types=cache_symbols(cfg, cpu), custom_extensions=[kernels_path()]) as g:
        kv = fetch(cfg)(*g.inputs)
        q = ops.constant(np.zeros((1, cfg.n_q, cfg.head_dim), np.float32), DType.float32, cpu)
        offsets = ops.constant(np.array([0, 1], np.uint32), DType.uint32, cpu)
        if case in BAD_WINDOWS:
            error, match, kwargs = ValueError, f"window_size must be an int >= 1 or None, got {case!r}", {
                "window_size": case}
        else:
            shape, dtype, error, match = case
            kwargs = {"sinks": ops.constant(np.zeros(shape, dtype.to_numpy()), dtype, cpu)}
        with pytest.raises(error, match=match):
            flash_attention(kv, q, offsets, 1, 0.1, **kwargs)
