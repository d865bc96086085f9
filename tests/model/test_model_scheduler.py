"""The scheduler over the real managers, with a stand-in model that needs no kernels.

`TokenCacheModel` plays the decoder's part in the cache: it stores each new token's id
where the fused QKV op would store its K (through the fetched lookup table into the
manager's own buffers) and, like attention, reads back the whole sequence from the
cache. It asserts that the cache holds exactly the context's tokens, so a prefix hit on
a wrong page, a page reused too early, or a missed reset after preemption fails here.
Its "next token" is a hash of the tokens it read, so outputs are checkable too.
"""

import mokv
import mokv_graphs as mg
import numpy as np
import pytest

VOCAB = 128


def next_token(tokens) -> int:
    tokens = np.asarray(tokens, dtype=np.int64)
    return int((tokens * np.arange(1, tokens.size + 1)).sum() * 7919 % VOCAB)


def expected_output(prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class TokenCacheModel:
    def __init__(self, manager):
        self.manager = manager
        self.paged = manager.layout is mokv.PAGED
        self.batch_sizes = []

    def _cell(self, blocks, table, b, pos):
        """Index of K[layer 0, head 0, dim 0] of position `pos` of batch entry `b`."""
        if self.paged:
            ps = self.manager.params.page_size
            return (table[b, pos // ps], 0, 0, pos % ps, 0, 0)
        return (table[b], 0, 0, pos, 0, 0)

    def __call__(self, batch):
        (inputs,) = self.manager.fetch(batch)
        blocks = inputs.blocks.to_numpy()  # aliases the manager's cache memory
        lengths, table = inputs.cache_lengths.to_numpy(), inputs.lookup_table.to_numpy()
        self.batch_sizes.append(len(batch))
        next_tokens = []
        for b, ctx in enumerate(batch):
            start = int(lengths[b])
            assert start == ctx.start_idx
            for i, tok in enumerate(ctx.next_tokens):
                blocks[self._cell(blocks, table, b, start + i)] = tok
            seen = [blocks[self._cell(blocks, table, b, p)] for p in range(ctx.active_idx)]
            np.testing.assert_array_equal(seen, ctx.tokens[: ctx.active_idx])
            next_tokens.append(next_token(seen))
        return next_tokens


def workload(rng, num_requests, system_len=40, user_len=(3, 20), max_new=(4, 12)):
    """Prompts that share one of two system prompts, then differ."""
    systems = [rng.integers(0, VOCAB, system_len) for _ in range(2)]
    return [
        mg.Request(
            mokv.TextContext(np.r_[systems[i % 2], rng.integers(0, VOCAB, rng.integers(*user_len))]),
            int(rng.integers(*max_new)),
        )
        for i in range(num_requests)
    ]


def run_all(scheduler, requests, arrive_per_step=2):
    """Feeds `arrive_per_step` requests per step until all are in, then drains."""
    pending, finished = list(requests), []
    while pending or scheduler.has_work:
        for _ in range(min(arrive_per_step, len(pending))):
            scheduler.add(pending.pop(0))
        finished += scheduler.step()
    return finished


@pytest.mark.parametrize("strategy", ["paged", "continuous"])
def test_outputs_and_cache_contents(make_kv_manager, strategy):
    manager = make_kv_manager(strategy)
    model = TokenCacheModel(manager)
    scheduler = mg.Scheduler(manager, model, token_budget=24)
    requests = workload(np.random.default_rng(0), 12)
    finished = run_all(scheduler, requests)
    assert len(finished) == len(requests) and not scheduler.has_work
    for req in requests:
        assert list(req.output) == expected_output(req.ctx.tokens[: req.prompt_len], req.max_new_tokens)
    assert max(model.batch_sizes) > 1  # requests really were batched together
    assert scheduler.stats.preemptions == 0
    if strategy == "paged":
        assert manager.metrics.cache_hit_rate > 0.2  # the shared system prompts
        assert manager.metrics.used_pages == 0
    capacity = manager.total_num_pages if strategy == "paged" else manager.max_cache_batch_size
    assert manager.num_free_blocks == capacity  # every page (slot) is free again


def test_preemption_under_page_pressure(make_kv_manager):
    """12 pages hold the prompts (27-35 tokens) of several requests but not the 20-30
    tokens each then decodes: the newest are preempted and recomputed."""
    manager = make_kv_manager("paged", num_pages=12)
    scheduler = mg.Scheduler(manager, TokenCacheModel(manager), token_budget=32)
    requests = workload(np.random.default_rng(1), 8, system_len=24, user_len=(3, 12),
                        max_new=(20, 30))
    run_all(scheduler, requests, arrive_per_step=8)
    assert scheduler.stats.preemptions > 0
    for req in requests:
        assert list(req.output) == expected_output(req.ctx.tokens[: req.prompt_len], req.max_new_tokens)
    manager.check_invariants()
    assert manager.metrics.used_pages == 0


def test_multi_turn_reuses_the_conversation(make_kv_manager):
    """A follow-up turn's prompt is the first turn's tokens plus new ones: a prefix hit."""
    manager = make_kv_manager("paged")
    scheduler = mg.Scheduler(manager, TokenCacheModel(manager), token_budget=64)
    first = mg.Request(mokv.TextContext(np.arange(50) % VOCAB), 10)
    run_all(scheduler, [first])
    hits_before = manager.metrics.cache_tokens
    second = mg.Request(mokv.TextContext(np.r_[first.ctx.tokens, [5, 6, 7]]), 5)
    run_all(scheduler, [second])
    assert manager.metrics.cache_tokens - hits_before >= 56  # 7 of 8 full pages reused
    assert list(second.output) == expected_output(second.ctx.tokens[: second.prompt_len], 5)



def test_hooks_see_admissions_and_steps(make_kv_manager):
    """`on_admit` sees the prefix the cache supplied; `on_step` comes before any release."""
    manager = make_kv_manager("paged")
    admitted, claimed_at_step = [], []

    class Observed(mg.Scheduler):
        def on_admit(self, req):
            admitted.append(req.ctx.start_idx)

        def on_step(self, batch):
            claimed_at_step.append(all(manager.contains(r.ctx.request_id) for r in batch))

    scheduler = Observed(manager, TokenCacheModel(manager), token_budget=64)
    first = mg.Request(mokv.TextContext(np.arange(50) % VOCAB), 10)
    run_all(scheduler, [first])
    run_all(scheduler, [mg.Request(mokv.TextContext(np.r_[first.ctx.tokens, [5, 6, 7]]), 5)])
    assert admitted == [0, 56]  # the second turn: 7 of its 8 full pages were cached
    assert len(claimed_at_step) == scheduler.stats.steps and all(claimed_at_step)
