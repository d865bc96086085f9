"""The demo decoder over FP8 pages with per-block scales (issue 53): a greedy workload
through an FP8 cache against the float64 reference's greedy tokens; the share of
requests whose tokens agree, and why the others differ (near ties of the reference)."""

from __future__ import annotations

import dataclasses

import mokv
import mokv_graphs as mg
import numpy as np
from max.driver import CPU
from max.dtype import DType

from .test_model_decode import serve, workload

CONFIG = mg.DecoderConfig(
    vocab_size=128, hidden_size=128, num_layers=2, n_heads=4, n_kv_heads=2, head_dim=128,
    intermediate_size=256, max_seq_len=256,
)
"""FP8 pages quantize 128 lanes per scale: heads of 128."""
PAGE_SIZE, PAGES = 8, 64


def fp8_manager(session):
    params = dataclasses.replace(
        CONFIG.kv_params("paged", page_size=PAGE_SIZE),
        dtype=DType.float8_e4m3fn,
        quantization=mokv.KVCacheQuantization(),
    )
    return mokv.load_kv_manager(
        params, max_batch_size=6, max_seq_len=96, num_layers=CONFIG.num_layers, devices=[CPU()],
        session=session, available_cache_memory=PAGES * params.bytes_per_page(CONFIG.num_layers),
        page_size=PAGE_SIZE,
    )


def test_greedy_tokens_over_fp8_pages(session):
    weights = mg.init_weights(CONFIG, seed=1)
    kv = fp8_manager(session)
    requests = workload(CONFIG, seed=4)
    serve(mg.DecoderModel(CONFIG, kv, session, weights), kv, requests)
    fp8 = [list(req.output) for req in requests]
    prompts = [req.ctx.tokens[: req.prompt_len] for req in requests]
    # The float64 reference's greedy tokens (a float32 cache gives the same:
    # test_model_decode). FP8 pages keep 5 of these 8 requests' tokens whole (measured
    # 2026-11-28); where a token differs, the FP8 run's is a near tie of the reference's
    # at that step: among its three best, within a tenth of the logits' spread of the best.
    reference = [
        list(mg.reference_generate(CONFIG, weights, prompt, len(out)))
        for prompt, out in zip(prompts, fp8)
    ]
    same = [a == b for a, b in zip(reference, fp8)]
    assert sum(same) >= 5, same
    for i, ok in enumerate(same):
        if ok:
            continue
        f64, f8 = reference[i], fp8[i]
        step = next(j for j, (a, b) in enumerate(zip(f64, f8)) if a != b)
        tokens = np.r_[prompts[i], f64[:step]].astype(np.int64)
        logits = mg.reference_logits(CONFIG, weights, tokens)[-1]
        spread = logits.max() - logits.min()
        gap = logits[f64[step]] - logits[f8[step]]
        rank = int((logits > logits[f8[step]]).sum())
        print(f"request {i}: first differing token {step}, gap {gap:.4f} of spread {spread:.3f}, "
              f"FP8's token ranked {rank}")
        assert 0 <= gap <= 0.1 * spread and rank <= 2, (i, step, gap, spread, rank)
