"""The host tier under the real decoder: prefixes evicted from device pages and loaded
back from host pages decode exactly like the uncached recompute.

The device holds a little more than one request's pages; the host tier holds every
prefix. Conversations take turns, so each turn's prefix was evicted from the device by
the others and comes back from the host tier (the TensorRT-LLM #8813 regression: with a
large host pool, outputs contained other prompts' tokens).
"""

import dataclasses

import mokv
import mokv_graphs as mg
import numpy as np
import pytest
from max.driver import CPU

from .conftest import CONFIG, MAX_BATCH_SIZE, MAX_SEQ_LEN, PAGE_SIZE
from .test_model_decode import ATOL

DEVICE_PAGES = 14  # max_seq_len needs 12
HOST_PAGES = 160


def host_tier_manager(session, dp: int = 1):
    params = CONFIG.kv_params("paged", page_size=PAGE_SIZE)
    bytes_per_page = params.bytes_per_page(CONFIG.num_layers)
    host = mokv.HostTierConfig(swap_space_gb=dp * HOST_PAGES * bytes_per_page / 2**30)
    params = dataclasses.replace(params, data_parallel_degree=dp, n_devices=dp, tiers=(host,))
    return mokv.load_kv_manager(
        params, max_batch_size=MAX_BATCH_SIZE, max_seq_len=MAX_SEQ_LEN,
        num_layers=CONFIG.num_layers, devices=[CPU()] * dp, session=session,
        available_cache_memory=dp * DEVICE_PAGES * bytes_per_page, page_size=PAGE_SIZE,
        enable_runtime_checks=True,
    )


def run_replicas(model, manager, batch):
    """Logits of `batch` (ordered by replica): one model call per replica's group."""
    logits = np.empty((len(batch), CONFIG.vocab_size), dtype=np.float32)
    for r in range(manager.num_replicas):
        rows = [i for i, ctx in enumerate(batch) if manager.get_replica(ctx) == r]
        if rows:
            group = [batch[i] for i in rows]
            inputs = manager.fetch(group)
            logits[rows] = model.execute(group, [inputs[r]])
    return logits


@pytest.mark.parametrize("dp", [1, 2])
def test_conversations_cycle_through_the_host_tier(config, weights, paged_model, session, dp):
    manager = host_tier_manager(session, dp)
    rng = np.random.default_rng(5)
    # Four conversations per replica; each turn appends to its conversation's tokens.
    conversations = [rng.integers(0, config.vocab_size, 30) for _ in range(4 * dp)]
    host_hits_seen = 0
    for turn in range(3):
        for first in range(0, len(conversations), dp):
            batch = []
            for c in range(first, first + dp):  # one request per replica, side by side
                ctx = mokv.TextContext(np.r_[conversations[c], rng.integers(0, 128, 3)])
                manager.external_claim(ctx.request_id, c % dp)
                before = manager.metrics.host_cache_tokens
                assert manager.maybe_reserve(ctx)
                if turn:  # the previous turn's full pages came back from the host tier
                    assert ctx.start_idx == (len(conversations[c]) - 1) // PAGE_SIZE * PAGE_SIZE
                    host_hits_seen += manager.metrics.host_cache_tokens > before
                batch.append(ctx)
            for _ in range(4):  # the prompt, then three decode steps
                logits = run_replicas(paged_model, manager, batch)
                for ctx, row in zip(batch, logits):
                    ref = mg.reference_logits(config, weights, ctx.tokens[: ctx.active_idx])[-1]
                    np.testing.assert_allclose(row, ref, atol=ATOL, rtol=0)
                    ctx.update(int(np.argmax(row)))
                manager.step(batch)
                for ctx in batch:
                    assert manager.maybe_reserve(ctx)
            for c, ctx in zip(range(first, first + dp), batch):
                conversations[c] = ctx.tokens[: ctx.end_idx]
                manager.release(ctx.request_id)
    metrics = manager.metrics
    assert host_hits_seen == 2 * len(conversations)  # every later turn hit the host tier
    assert metrics.host_cache_tokens > 0 and metrics.bytes_from_host > 0
    assert metrics.host_used_pages <= metrics.host_total_pages == dp * HOST_PAGES
    manager.check_invariants()
    assert manager.num_free_blocks == manager.total_num_pages


def test_served_outputs_with_a_tiny_device_and_a_large_host_tier(
    config, weights, paged_model, session
):
    """The scheduler, with preemptions: every output equals greedy uncached decoding."""
    manager = host_tier_manager(session)
    rng = np.random.default_rng(6)
    systems = [rng.integers(0, config.vocab_size, 24) for _ in range(5)]
    requests = [
        mg.Request(mokv.TextContext(np.r_[systems[i % 5], rng.integers(0, 128, 4 + i % 3)]), 6)
        for i in range(15)
    ]
    scheduler = mg.Scheduler(manager, mg.greedy(paged_model.step), token_budget=32)
    paged_model.manager = manager
    pending = list(requests)
    while pending or scheduler.has_work:
        if pending:
            scheduler.add(pending.pop(0))
        scheduler.step()
    for req in requests:
        assert mg.first_mismatch(config, weights, req.ctx.tokens, req.prompt_len) is None
    assert manager.metrics.host_cache_tokens > 0
    manager.check_invariants()
