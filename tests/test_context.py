"""TextContext: the token regions a manager reads, chunked prefill and reset."""

import numpy as np
import pytest
from mokv import MultimodalInput, RequestID, TextContext, TextGenerationContext


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


# --- issue 56: every field is checked when given, and when set later ------------------

FIELD_CHECKS = [
    ("cache_salt", [0, False, b"", (), 7, ["t"]], TypeError, "cache_salt must be a str or None"),
    ("lora_name", [0, False, "", b"x"], TypeError, "lora_name must be a non-empty str or None"),
    ("session_id", [0, "", ()], TypeError, "session_id must be a non-empty str or None"),
    ("mm_inputs", [0, None, "img", [("x", 0, 4)], [MultimodalInput("a", 8, 4)]],
     (TypeError, ValueError), "mm_inputs|ends past"),
    ("max_length", [0, -1, 1.5, True, "9", 4], ValueError, "max_length must be None or an int"),
]


@pytest.mark.parametrize("name,values,error,match", FIELD_CHECKS, ids=lambda v: str(v)[:20])
def test_a_bad_field_is_refused_given_and_set_later(name, values, error, match):
    for value in values:
        with pytest.raises(error, match=match):
            TextContext(np.arange(9), **{name: value})
        ctx = TextContext(np.arange(9), lora_name="l")
        before = getattr(ctx, name)
        with pytest.raises(error, match=match):
            setattr(ctx, name, value)  # a server setting it afterwards: refused the same
        assert getattr(ctx, name) == before  # unchanged


def test_good_fields_set_later_are_kept():
    ctx = TextContext(np.arange(9))
    ctx.cache_salt, ctx.lora_name, ctx.session_id = "t", "l", "s"
    ctx.lora_id = 3
    ctx.mm_inputs = [MultimodalInput("a", 0, 4)]
    ctx.max_length = 12
    assert (ctx.cache_salt, ctx.lora_name, ctx.lora_id, ctx.session_id) == ("t", "l", 3, "s")
    assert ctx.mm_inputs == (MultimodalInput("a", 0, 4),) and ctx.max_length == 12
    with pytest.raises(ValueError, match="set lora_id to None first"):
        ctx.lora_name = None
    with pytest.raises(TypeError, match="lora_id must be an int >= 0 or None, got '3'"):
        ctx.lora_id = "3"
    ctx.lora_id = None
    ctx.lora_name = None


def test_request_ids_chunks_and_skips_take_what_they_name():
    with pytest.raises(TypeError, match="a RequestID is made of a str, got int 5"):
        TextContext(np.arange(3), request_id=5)  # was the id "5"
    with pytest.raises(TypeError, match="got bytes b'r'"):
        RequestID(b"r")
    ctx = TextContext(np.arange(10))
    for bad in (2.5, True, 0):
        with pytest.raises(ValueError, match=f"max_tokens must be an int >= 1, got {bad!r}"):
            ctx.chunk(bad)
    with pytest.raises(ValueError, match="cannot skip to 4.0"):
        ctx.skip_cached_prefix(4.0)  # was a float start_idx
    assert (ctx.start_idx, ctx.active_idx) == (0, 10)


def test_token_errors_name_the_tokens():
    # The message named only the dtype ("<U1"), not the value given.
    with pytest.raises(TypeError, match=r"integer token ids, got \['a', 'b'\] \(dtype <U1\)"):
        TextContext(["a", "b"])
    with pytest.raises(TypeError, match=r"got \[0\.5, 1\.5\]"):
        TextContext([0.5, 1.5])
    with pytest.raises(TypeError, match=r"got \[0, 1, 2, 3, .*\.\.\. \(dtype"):
        TextContext([0, 1, 2, 3, "x"] * 50)  # a long prompt is cut in the message
