"""Cache control over HTTP, the pieces (`mokv.pipelines.cache_control`): the hint's and the
messages' shapes, refusals by name, what MAX's context carries to the model worker, and
the usage counters (the server test sends them through `mokv serve`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from max.pipelines.context import TextContext, TokenBuffer
from mokv import CacheControl
from mokv.pipelines import cache_control
from mokv.pipelines.cache_control import cache_control_of, marked_cache_control
from mokv.pipelines.context_view import MaxContextView
from openai.types import CompletionUsage
from openai.types.completion_usage import PromptTokensDetails


def test_the_hint_s_shapes():
    assert cache_control_of(None) is None and cache_control_of({"session_id": "a"}) is None
    assert cache_control_of({"cache_control": {"type": "ephemeral"}}) == CacheControl(300.0)
    assert cache_control_of(
        {"cache_control": {"type": "ephemeral", "ttl": "1h"}, "write_policy": "read_only"}
    ) == CacheControl(3600.0, write="read_only")
    assert cache_control_of({"write_policy": {"prefix_tokens": 256}}) == CacheControl(
        write="prefix", write_limit_tokens=256
    )
    for bad, name in (
        ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "ttl"),
        ({"cache_control": {"type": "ephemeral", "scope": "x"}}, "scope"),
        ({"cache_control": "1h"}, "ephemeral"),
        ({"write_policy": "none"}, "write_policy"),
        ({"write_policy": {"prefix_tokens": -1}}, "write_limit_tokens"),
    ):
        with pytest.raises(ValueError, match=name):
            cache_control_of(bad)


def test_the_last_marked_message_or_content_part():
    mark = {"type": "ephemeral", "ttl": "1h"}
    messages = [
        {"role": "system", "content": "s", "cache_control": {"type": "ephemeral"}},
        {"role": "user", "content": [{"type": "text", "text": "u", "cache_control": mark}]},
        {"role": "assistant", "content": "a"},
    ]
    assert marked_cache_control(messages) is mark
    assert marked_cache_control([{"role": "user", "content": "u"}]) is None
    assert marked_cache_control(None) is None


def max_context(hint):
    ctx = TextContext(max_length=64, tokens=TokenBuffer(np.arange(10, dtype=np.int64)))
    ctx.dkv_cache_hint = json.dumps(hint).encode() if hint is not None else None
    return ctx


class Request:
    """What MAX's routes hand the tokenizer (`TextGenerationRequest`'s fields read)."""

    def __init__(self, hint=None, messages=None, request_id="r"):
        self.dkv_cache_hint, self.messages, self.request_id = hint, messages, request_id


def test_carry_writes_a_message_s_mark_onto_the_context_and_the_view_reads_it():
    ctx = max_context({"session_id": "s"})
    mark = {"type": "ephemeral", "ttl": "1h"}
    cache_control.carry(Request({"session_id": "s"}, [{"role": "user", "cache_control": mark}]),
                        ctx, page_size=4, pins=True)
    view = MaxContextView(ctx)
    assert view.session_id == "s" and view.cache_control == CacheControl(3600.0)
    assert MaxContextView(max_context(None)).cache_control is None
    with pytest.raises(ValueError, match="pins"):
        cache_control.carry(Request({"cache_control": mark}), max_context(None), 4, pins=False)
    cache_control.carry(Request({"write_policy": "read_only"}), max_context(None), 4, pins=False)


def test_usage_counts_what_the_request_read_and_wrote():
    from max.serve.router.openai_routes import CreateCompletionResponse

    response = cache_control.with_cache_usage(CreateCompletionResponse)

    def counted(prompt, cached, request_id="r"):
        usage = CompletionUsage(
            prompt_tokens=prompt,
            completion_tokens=1,
            total_tokens=prompt + 1,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )
        built = response(id=request_id, choices=[], created=0, model="m",
                         object="text_completion", usage=usage)
        dumped = json.loads(built.model_dump_json())["usage"]  # extras of a base-typed field
        return dumped["cache_read_input_tokens"], dumped["cache_creation_input_tokens"]

    for hint, cached, expected in (
        (None, 0, (0, 8)),
        (None, 4, (4, 4)),
        (None, 8, (8, 0)),
        ({"write_policy": {"prefix_tokens": 5}}, 0, (0, 4)),
        ({"write_policy": {"prefix_tokens": 5}}, 8, (8, 0)),
        ({"write_policy": "read_only"}, 4, (4, 0)),
    ):
        cache_control.carry(Request(hint), max_context(None), page_size=4, pins=False)
        assert counted(10, cached) == expected
    assert counted(10, 4, "never-carried") == (4, 0)  # nothing noted: nothing written known
