"""Managers' edge inputs from issue 41, one test each: every one is refused with a typed
error naming the request or the value, and changes nothing. Hand-made contexts stand
for a server's own context class (the `TextGenerationContext` protocol), which does not
check what `TextContext` checks."""

from __future__ import annotations

from dataclasses import dataclass, field

import mokv
import numpy as np
import pytest
from max.driver import CPU
from mokv import TextContext

from .conftest import NUM_LAYERS, make_paged, small_params
from .paged.test_sessions import turn


@dataclass
class HandMade:
    """A context whose fields are whatever a buggy server sets."""

    request_id: mokv.RequestID
    tokens: np.ndarray
    start_idx: int = 0
    active_idx: int = -1
    end_idx: int = -1
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    mm_inputs: object = ()
    session_id: str | None = None
    skipped: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.end_idx < 0:
            self.end_idx = len(self.tokens)
        if self.active_idx < 0:
            self.active_idx = self.end_idx

    @property
    def active_length(self) -> int:
        return self.active_idx - self.start_idx

    def active_idx_after_skip(self, num_tokens: int) -> int:
        return min(self.end_idx, num_tokens + max(self.active_length, 1))

    def skip_cached_prefix(self, num_tokens: int) -> None:
        self.active_idx = self.active_idx_after_skip(num_tokens)
        self.start_idx = num_tokens

    def update(self, new_token: int) -> None:
        raise NotImplementedError


def continuous(session, max_seq_len=16):
    return mokv.ContinuousKVCacheManager(
        small_params(cache_strategy="continuous"), 3, max_seq_len, NUM_LAYERS, [CPU()], session)


def null(session, **kwargs):
    return mokv.NullKVCacheManager(small_params(), 2, 16, NUM_LAYERS, [CPU()], session, 0,
                                   **kwargs)


def claimed(m, *contexts):
    for ctx in contexts:
        m.external_claim(ctx.request_id)
    return contexts


@pytest.mark.parametrize("make", [make_paged, continuous, null])
def test_a_request_twice_in_a_batch_is_named(session, make):
    m = make(session)
    (b,) = claimed(m, TextContext([1, 2, 3], "B"))
    free = m.num_free_blocks
    with pytest.raises(ValueError, match="request RequestID\\('B'\\) appears twice"):
        m.fetch([b, b])
    if make is make_paged:
        with pytest.raises(ValueError, match="request RequestID\\('B'\\) appears twice"):
            m.step([b, b])
    assert m.num_free_blocks == free  # nothing taken


def test_a_fetch_the_pool_cannot_hold_names_its_requests(session):
    m = make_paged(session, num_pages=8)
    a, c = claimed(m, TextContext(np.arange(20), "A"), TextContext(np.arange(100, 113), "C"))
    m.fetch([a])  # 5 of the 8 pages
    with pytest.raises(mokv.InsufficientPagesError,
                       match=r"requests \[RequestID\('C'\)\] need 4 fresh pages of replica 0, "
                             r"which has 3 free"):
        m.fetch([c])
    assert m.get_req_blocks("C") == [] and m.num_free_blocks == 3


@pytest.mark.parametrize("make", [make_paged, continuous])
def test_increment_cache_lengths_names_what_it_got(session, make):
    m = make(session)
    (a,) = claimed(m, TextContext([1, 2, 3], "A"))
    inputs = m.fetch([a], num_steps=2)
    with pytest.raises(TypeError, match="input_row_offsets .*got NoneType None"):
        m.increment_cache_lengths(inputs, None)
    with pytest.raises(TypeError, match="kv_cache_inputs must be the list fetch returned, "
                                        "got NoneType"):
        m.increment_cache_lengths(None, np.array([0, 3], dtype=np.uint32))


def test_float_tokens_never_hit_integer_pages(session):
    m = make_paged(session)
    (a,) = claimed(m, TextContext(np.arange(9), "A"))
    m.fetch([a])
    a.update(1)
    m.step([a])  # pages of tokens 0-3 and 4-7 committed
    floats = HandMade(mokv.RequestID("F"), np.arange(9) + 0.25)  # truncates to 0..8
    m.external_claim(floats.request_id)
    with pytest.raises(TypeError, match="request RequestID\\('F'\\) has tokens of dtype float64"):
        m.maybe_reserve(floats)
    assert floats.start_idx == 0 and m.get_req_blocks("F") == []


@pytest.mark.parametrize("make", [make_paged, continuous, null])
@pytest.mark.parametrize("start,active", [(5, 3), (-3, 4), (2, 2)])
def test_a_window_a_step_cannot_process_is_refused(session, make, start, active):
    m = make(session)
    ctx = HandMade(mokv.RequestID("W"), np.arange(6), start_idx=start, active_idx=active)
    claimed(m, ctx)
    with pytest.raises(ValueError, match=f"start_idx={start}, active_idx={active}, end_idx=6: "
                                         "a step needs 0 <= start_idx < active_idx"):
        m.fetch([ctx])
    if make is not make_paged:  # the paged maybe_reserve holds such a window already, or
        with pytest.raises(ValueError, match=f"start_idx={start}"):  # finds it stale
            m.maybe_reserve(ctx)


def test_the_continuous_manager_refuses_what_the_paged_one_refuses(session):
    m = continuous(session)
    a, floats = claimed(m, TextContext([1, 2, 3], "A"),
                        HandMade(mokv.RequestID("F"), np.array([1.5, 2.5])))
    with pytest.raises(mokv.UnknownRequestError, match="'nobody'"):
        m.get_data_parallel_splits([a, TextContext([1], "nobody")])
    with pytest.raises(TypeError, match="RequestID\\('F'\\) has tokens of dtype float64"):
        m.fetch([floats])
    with pytest.raises(TypeError, match="dtype float64"):
        m.maybe_reserve(floats)
    a.update(7)  # a step the manager never reserved
    with pytest.raises(mokv.StaleContextError, match="start_idx=3 but only 0 tokens of cache "
                                                     "were reserved"):
        m.step([a])
    b = TextContext([4, 5], "B")
    m.external_claim("B")
    m.fetch([b])
    b.update(1)
    m.step([b])  # reserved by fetch: fine
    assert m.metrics.input_tokens == 2


@pytest.mark.parametrize("num_steps,prompt", [(1, 17), (5, 13)])
def test_the_null_manager_refuses_what_does_not_fit(session, num_steps, prompt):
    m = null(session)
    (ctx,) = claimed(m, TextContext(np.arange(prompt), "L"))
    needed = prompt + num_steps - 1
    match = f"needs {needed} tokens of cache for {num_steps} step\\(s\\), past max_seq_len=16"
    with pytest.raises(mokv.SequenceTooLongError, match=match):
        m.maybe_reserve(ctx, num_steps)
    with pytest.raises(mokv.SequenceTooLongError, match=match):
        m.fetch([ctx], num_steps)


def test_the_null_manager_refuses_a_page_size_its_params_disagree_with(session):
    with pytest.raises(ValueError, match="page_size=16 disagrees with params.page_size=4"):
        null(session, page_size=16)
    assert null(session, page_size=4).page_size == 4


# --- issue 56: the keys a manager reads are checked where it reads them ---------------

PROMPT = np.arange(9)  # two full pages of 4, then one token


def a_cached_prompt(session, **overrides):
    """A manager holding PROMPT's two pages, committed by an unsalted request."""
    m = make_paged(session, **overrides)
    turn(m, PROMPT)
    return m


@pytest.mark.parametrize("keys,error,match", [
    # A falsy key of another type meant "no tenant": the unsalted pages were reused.
    (dict(cache_salt=0), TypeError, "cache_salt must be a str or None, got 0"),
    (dict(cache_salt=False), TypeError, "got False"),
    (dict(cache_salt=b""), TypeError, "got b''"),
    (dict(cache_salt=()), TypeError, r"got \(\)"),
    (dict(lora_name=0), TypeError, "lora_name must be a non-empty str or None, got 0"),
    (dict(lora_name=""), TypeError, "lora_name.*got ''"),
    (dict(cache_salt=7), TypeError, "got 7"),
    # An image that is not a MultimodalInput raised an AttributeError; spans were unchecked.
    (dict(mm_inputs=[("x", 0, 4)]), TypeError, r"mm_inputs holds \('x', 0, 4\)"),
    (dict(mm_inputs=0), TypeError, "mm_inputs must be a sequence.*0"),
    (dict(mm_inputs=[mokv.MultimodalInput("a", 4, 4), mokv.MultimodalInput("b", 0, 2)]),
     ValueError, "ordered by offset"),
    (dict(mm_inputs=[mokv.MultimodalInput("a", 0, 4), mokv.MultimodalInput("b", 2, 4)]),
     ValueError, "not overlap"),
    (dict(mm_inputs=[mokv.MultimodalInput("a", 6, 4)]), ValueError, "ends past the prompt's 9"),
    (dict(session_id=0), TypeError, "session_id must be a non-empty str or None, got 0"),
    (dict(lora_name="x", lora_id="1"), TypeError, "lora_id must be an int >= 0 or None, got '1'"),
    (dict(lora_id=3), ValueError, "lora_id=3 needs a lora_name"),
])
def test_a_key_of_the_wrong_type_or_span_is_refused_and_changes_nothing(session, keys, error,
                                                                       match):
    m = a_cached_prompt(session, sessions=mokv.SessionConfig())
    ctx = HandMade(mokv.RequestID("r"), PROMPT, **keys)
    m.external_claim(ctx.request_id)
    free = m.num_free_blocks
    with pytest.raises(error, match=match):
        m.maybe_reserve(ctx)
    assert ctx.start_idx == 0 and m.get_req_blocks(ctx.request_id) == []
    assert m.num_free_blocks == free
    m.check_invariants()
    with pytest.raises(error, match=match):
        m.fetch([ctx])
    assert m.get_req_blocks(ctx.request_id) == []


def test_a_key_changed_to_a_bad_one_before_step_is_refused_there(session):
    m = a_cached_prompt(session)
    ctx = HandMade(mokv.RequestID("r"), np.arange(100, 109), cache_salt="tenant")
    m.external_claim(ctx.request_id)
    m.fetch([ctx])
    ctx.start_idx = ctx.end_idx  # the step processed the prompt
    ctx.cache_salt = 0
    with pytest.raises(TypeError, match="cache_salt must be a str or None, got 0"):
        m.step([ctx])
    assert m.replicas[0].committed_hashes(ctx.request_id) == []  # nothing committed
    ctx.cache_salt = "tenant"
    m.step([ctx])
    assert len(m.replicas[0].committed_hashes(ctx.request_id)) == 2
