"""flash_attention with a sliding window, against numpy, on both kinds of CPU path: a
window that starts mid-page, decode far past many windows, prefill longer than the
window, a chunk after a long cache, keys split across cores, every decode form. The
keys and values before each sequence's first window are NaN (`run_store_attention`):
the kernel reads no key there, so a sliding-window group's released pages (the pad
page in its table) can never reach an output."""

from __future__ import annotations

import dataclasses

import pytest
from max.dtype import DType

from .conftest import plan_graphs
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
WINDOWED = [F32_GQA4, BF16_GQA8, BF16_GQA1, BF16_GQA4, F32_GQA8]
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


@pytest.mark.parametrize("cfg", WINDOWED, ids=lambda c: f"{c.dtype.name}-g{c.group}-w{c.window}")
@pytest.mark.parametrize("cache_lengths,new_tokens", CASES)
def test_a_window_reads_only_its_keys(compiled_each_path, cfg, cache_lengths, new_tokens):
    cache, before, k, v, q, offsets, out = run_store_attention(
        compiled_each_path, cfg, cache_lengths, new_tokens, seed=len(cache_lengths)
    )
    check(cfg, cache, before, k, v, q, offsets, out)


def test_the_window_is_checked_where_it_is_given():
    from max.graph import DeviceRef, Graph
    from mokv.ops import flash_attention, kernels_path

    from .conftest import cache_symbols, fetch

    cfg = F32_GQA4
    with Graph("bad_window", input_types=[*cache_symbols(cfg, DeviceRef.CPU())],
               custom_extensions=[kernels_path()]) as g:
        kv = fetch(cfg)(*g.inputs)
        from max.graph import TensorType, ops
        q = ops.constant(0.0, DType.float32, DeviceRef.CPU()).broadcast_to([1, cfg.n_q, cfg.head_dim])
        offsets = ops.constant([0, 1], DType.uint32, DeviceRef.CPU())
        for bad in (0, -3, 2.5, True):
            with pytest.raises(ValueError, match="window_size must be an int >= 1"):
                flash_attention(kv, q, offsets, 1, 0.1, window_size=bad)
        del TensorType
