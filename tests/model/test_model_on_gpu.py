"""The decoder end to end on a GPU, on both caches: the manager's pages on the device, the
graph's ops there, logits equal to the numpy float64 reference.

Skipped unless MAX sees an accelerator (`max.driver.accelerator_count() > 0`);
`benchmarks/gpu_machine.sh tests` runs it on a GPU machine without network.
"""

from __future__ import annotations

import mokv
import mokv_graphs as mg
import numpy as np
import pytest
from max.driver import CPU, Accelerator, accelerator_count
from max.engine import InferenceSession

from .conftest import CONFIG, MAX_BATCH_SIZE
from .test_model_decode import finish_step, new_request, run

pytestmark = pytest.mark.skipif(
    accelerator_count() == 0, reason="needs a GPU (runs where MAX sees an accelerator)"
)

ATOL = 2e-2
"""MAX's float32 matmuls run on TF32 tensor cores on an NVIDIA GPU (docs/gpus.md: errors
~4e-4 on O(1) values), which the decoder's projections compound; logits are of scale ~4.
The CPU tests hold the same decoder to 2e-4."""


PAGE_SIZE = 128
"""MAX's attention kernel, which mokv's op runs on a GPU, takes pages of 128 tokens or a
multiple (the CPU tests use pages of 8)."""


def gpu_manager(session, gpu, strategy: str):
    params = CONFIG.kv_params(strategy, page_size=PAGE_SIZE, enable_prefix_caching=True)
    return mokv.load_kv_manager(
        params, max_batch_size=MAX_BATCH_SIZE, max_seq_len=CONFIG.max_seq_len,
        num_layers=CONFIG.num_layers, devices=[gpu], session=session, page_size=PAGE_SIZE,
        available_cache_memory=8 * params.bytes_per_page(CONFIG.num_layers),
    )


@pytest.fixture(scope="module")
def on_gpu():
    gpu = Accelerator()
    return gpu, InferenceSession(devices=[CPU(), gpu])


def assert_close_to_reference(weights, ctx, logits_row):
    """Within ATOL of the reference, and the same greedy token wherever the reference's
    best two logits are further apart than the tolerance allows to swap."""
    ref = mg.reference_logits(CONFIG, weights, ctx.tokens[: ctx.active_idx])[-1]
    np.testing.assert_allclose(logits_row, ref, atol=ATOL, rtol=0)
    second, first = np.sort(ref)[-2:]
    if first - second > 2 * ATOL:
        assert np.argmax(logits_row) == np.argmax(ref)


@pytest.mark.parametrize("strategy", ["paged", "continuous"])
def test_decoder_on_gpu_matches_reference(weights, on_gpu, strategy):
    """Prefill two requests, decode both, then (paged) a third that reuses the first's
    prefix page while the others decode on."""
    gpu, session = on_gpu
    manager = gpu_manager(session, gpu, strategy)
    model = mg.DecoderModel(CONFIG, manager, session, weights)
    rng = np.random.default_rng(0)
    system = rng.integers(0, CONFIG.vocab_size, PAGE_SIZE)
    a = new_request(manager, np.r_[system, [1, 2, 3]])
    b = new_request(manager, rng.integers(0, CONFIG.vocab_size, 5))
    batch = [a, b]
    for step in range(6):
        if step == 3:
            c = new_request(manager, np.r_[system, [4, 5]])
            batch.append(c)
        logits = run(model, manager, batch)
        if step == 3 and strategy == "paged":
            assert c.start_idx == PAGE_SIZE  # `a`'s first page
        for ctx, row in zip(batch, logits):
            assert_close_to_reference(weights, ctx, row)
        finish_step(manager, batch, logits)
    assert a.end_idx == PAGE_SIZE + 9 and b.end_idx == 11 and c.end_idx == PAGE_SIZE + 5
