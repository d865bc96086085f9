"""TextContext: the token regions a manager reads, chunked prefill and reset."""

import numpy as np
import pytest
from mokv import RequestID, TextContext, TextGenerationContext


def test_fresh_context_has_whole_prompt_active():
    ctx = TextContext(np.arange(5), request_id="r")
    assert isinstance(ctx, TextGenerationContext)
    assert ctx.request_id == RequestID("r")
    assert (ctx.start_idx, ctx.active_idx, ctx.end_idx) == (0, 5, 5)
    assert ctx.next_tokens.tolist() == [0, 1, 2, 3, 4]


def test_update_appends_and_moves_window():
    ctx = TextContext([1, 2, 3])
    ctx.update(9)
    assert (ctx.start_idx, ctx.active_idx, ctx.end_idx) == (3, 4, 4)
    assert ctx.next_tokens.tolist() == [9]
    for t in range(40):  # grows past the initial buffer
        ctx.update(t)
    assert ctx.tokens.tolist() == [1, 2, 3, 9] + list(range(40))
    assert ctx.generated_tokens.tolist() == [9] + list(range(40))


def test_chunked_prefill_finishes_chunks_without_appending():
    ctx = TextContext(np.arange(10))
    ctx.chunk(4)
    assert ctx.next_tokens.tolist() == [0, 1, 2, 3]
    ctx.update(99)  # intermediate chunk: the token is not a sample
    assert (ctx.start_idx, ctx.active_idx, ctx.end_idx) == (4, 10, 10)
    ctx.update(7)
    assert ctx.tokens[-1] == 7 and ctx.end_idx == 11


def test_reset_folds_generated_tokens_into_prompt():
    ctx = TextContext([1, 2])
    ctx.update(3)
    ctx.update(4)
    ctx.reset()
    assert (ctx.start_idx, ctx.active_idx, ctx.end_idx, ctx.prompt_length) == (0, 4, 4, 4)


def test_skip_cached_prefix_keeps_window_and_one_token():
    ctx = TextContext(np.arange(10))
    ctx.chunk(3)
    ctx.skip_cached_prefix(4)
    assert (ctx.start_idx, ctx.active_idx) == (4, 7)
    with pytest.raises(ValueError, match="cannot skip to 10"):
        ctx.skip_cached_prefix(10)


def test_bad_contexts_are_rejected():
    with pytest.raises(ValueError, match="at least one"):
        TextContext([])
    ctx = TextContext([1], max_length=2)
    ctx.update(2)
    with pytest.raises(ValueError, match="max_length=2"):
        ctx.update(3)


def test_active_idx_after_skip_is_the_window_rule_and_pure():
    ctx = TextContext(np.arange(20))
    ctx.chunk(4)  # window [0, 4)
    assert ctx.active_idx_after_skip(8) == 12  # keeps its length
    assert ctx.active_idx_after_skip(18) == 20  # stops at end_idx
    assert (ctx.start_idx, ctx.active_idx) == (0, 4)  # asking changed nothing
    ctx.skip_cached_prefix(8)
    assert (ctx.start_idx, ctx.active_idx) == (8, 12)
    with pytest.raises(ValueError, match="cannot skip to 20"):
        ctx.active_idx_after_skip(20)
