"""Cached decoding through mokv's kernels equals a recompute without any cache.

The ground truth is the numpy decoder (`mokv_graphs.reference_logits`), which shares
only the config and the checkpoint with the graph. One compiled decoder per cache kind
serves every test (compiles are slow here); each test brings fresh managers.
"""

import mokv
import mokv_graphs as mg
import numpy as np
import pytest

ATOL = 2e-4  # float32 kernels vs the float64 reference, logits of scale ~4


@pytest.fixture(params=["paged", "continuous"])
def strategy(request):
    return request.param


@pytest.fixture
def model(strategy, request):
    return request.getfixturevalue(f"{strategy}_model")


def run(model, manager, contexts):
    """One step for `contexts` on `manager` (reserving first): logits [batch, vocab]."""
    for ctx in contexts:
        assert manager.maybe_reserve(ctx)
    return model.execute(contexts, manager.fetch(contexts))


def finish_step(manager, contexts, logits):
    for ctx, row in zip(contexts, logits):
        ctx.update(int(np.argmax(row)))
    manager.step(contexts)


def assert_matches_reference(config, weights, ctx, logits_row):
    """`logits_row` is what the model predicted after ctx.tokens[:ctx.active_idx]."""
    ref = mg.reference_logits(config, weights, ctx.tokens[: ctx.active_idx])[-1]
    np.testing.assert_allclose(logits_row, ref, atol=ATOL, rtol=0)
    assert np.argmax(logits_row) == np.argmax(ref)


def new_request(manager, tokens):
    ctx = mokv.TextContext(np.asarray(tokens))
    manager.external_claim(ctx.request_id)
    return ctx


def test_prefill_then_decode(config, weights, strategy, model, make_kv_manager):
    manager = make_kv_manager(strategy)
    rng = np.random.default_rng(0)
    a = new_request(manager, rng.integers(0, config.vocab_size, 21))
    b = new_request(manager, rng.integers(0, config.vocab_size, 3))
    for _step in range(8):  # step 0 prefills both, then both decode together
        logits = run(model, manager, [a, b])
        for ctx, row in zip([a, b], logits):
            assert_matches_reference(config, weights, ctx, row)
        finish_step(manager, [a, b], logits)
    assert a.end_idx == 29 and b.end_idx == 11


def test_chunked_prefill_mixed_with_decode(config, weights, strategy, model, make_kv_manager):
    """A prompt fed in chunks of 5 next to a decoding request gives the same logits."""
    manager = make_kv_manager(strategy)
    rng = np.random.default_rng(1)
    decoding = new_request(manager, rng.integers(0, config.vocab_size, 9))
    finish_step(manager, [decoding], run(model, manager, [decoding]))
    chunked = new_request(manager, rng.integers(0, config.vocab_size, 23))
    while chunked.end_idx == 23:  # until the last chunk produced a token
        chunked.chunk(5)
        logits = run(model, manager, [decoding, chunked])
        assert_matches_reference(config, weights, decoding, logits[0])
        if not chunked.is_chunked:
            assert_matches_reference(config, weights, chunked, logits[1])
        finish_step(manager, [decoding, chunked], logits)


def test_prefix_hits_and_shared_pages(config, weights, paged_model, make_kv_manager):
    """Requests sharing a 40-token prefix reuse its pages, concurrently and after release."""
    manager = make_kv_manager("paged")
    rng = np.random.default_rng(2)
    system = rng.integers(0, config.vocab_size, 40)
    first = new_request(manager, np.r_[system, [1, 2, 3]])
    finish_step(manager, [first], run(paged_model, manager, [first]))

    second = new_request(manager, np.r_[system, [4, 5, 6, 7]])
    logits = run(paged_model, manager, [second])
    assert second.start_idx == 40 and manager.metrics.cache_tokens == 40  # 5 pages reused
    shared = set(manager.get_req_blocks(first.request_id)) & set(manager.get_req_blocks(second.request_id))
    assert len(shared) == 5
    assert_matches_reference(config, weights, second, logits[0])
    finish_step(manager, [second], logits)
    for _ in range(3):  # both keep decoding on the shared pages
        logits = run(paged_model, manager, [first, second])
        for ctx, row in zip([first, second], logits):
            assert_matches_reference(config, weights, ctx, row)
        finish_step(manager, [first, second], logits)

    manager.release(first.request_id)
    manager.release(second.request_id)
    third = new_request(manager, np.r_[system, [9]])  # all owners gone: cached-free pages
    logits = run(paged_model, manager, [third])
    assert third.start_idx == 40
    assert_matches_reference(config, weights, third, logits[0])


def serve(model, manager, requests, token_budget=32):
    """All `requests` through the Scheduler (two arrive per step); returns its stats."""
    scheduler = mg.Scheduler(
        manager, mg.greedy(lambda b: model.execute(b, manager.fetch(b))), token_budget
    )
    pending = list(requests)
    while pending or scheduler.has_work:
        for _ in range(min(2, len(pending))):
            scheduler.add(pending.pop(0))
        scheduler.step()
    return scheduler.stats


def workload(config, seed, n=8):
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, config.vocab_size, 30) for _ in range(2)]
    return [
        mg.Request(mokv.TextContext(np.r_[systems[i % 2], rng.integers(0, config.vocab_size, 5 + 3 * i)]),
                   int(rng.integers(6, 14)))
        for i in range(n)
    ]


def test_served_outputs_after_page_reuse_and_preemption(config, weights, paged_model, make_kv_manager):
    """A pool of 14 pages for 8 requests: pages are evicted, reused, requests preempted."""
    manager = make_kv_manager("paged", num_pages=14)
    requests = workload(config, seed=3)
    stats = serve(paged_model, manager, requests)
    assert stats.preemptions > 0 and manager.metrics.cache_hit_rate > 0
    for req in requests:
        assert mg.first_mismatch(config, weights, req.ctx.tokens, req.prompt_len) is None
    manager.check_invariants()


def test_paged_and_continuous_agree(config, paged_model, continuous_model, make_kv_manager):
    outputs = {}
    for strategy, model in (("paged", paged_model), ("continuous", continuous_model)):
        requests = workload(config, seed=4)
        serve(model, make_kv_manager(strategy), requests)
        outputs[strategy] = [list(req.output) for req in requests]
    assert outputs["paged"] == outputs["continuous"]
