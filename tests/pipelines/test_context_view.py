"""MaxContextView: mokv's request protocol read off MAX 26.7's own request contexts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from max.pipelines.context import TextAndVisionContext, TextContext, TokenBuffer
from max.pipelines.context.tokens import ImageMetadata
from mokv import MultimodalInput
from mokv.pipelines import MaxContextView


def max_context(n: int, **fields) -> TextContext:
    return TextContext(max_length=4096, tokens=TokenBuffer(np.arange(n, dtype=np.int64)), **fields)


def test_the_indices_are_max_token_buffer_s_live():
    ctx = max_context(300)
    view = MaxContextView(ctx)
    assert (view.start_idx, view.active_idx, view.end_idx, view.active_length) == (0, 300, 300, 300)
    np.testing.assert_array_equal(view.tokens, np.arange(300))
    ctx.tokens.skip_processing(256)
    assert (view.start_idx, view.active_idx) == (256, 300)
    ctx.tokens.advance_with_token(7)  # a step ran on [256, 300) and sampled a token
    assert (view.start_idx, view.active_idx, view.end_idx) == (300, 301, 301)


def test_a_prompt_is_reserved_one_chunked_prefill_budget_at_a_time():
    view = MaxContextView(max_context(1000), max_num_input_tokens=256)
    assert (view.active_idx, view.active_length) == (256, 256)
    assert view.active_idx_after_skip(128) == 384  # the budget runs from the new start
    assert view.active_idx_after_skip(900) == 1000  # ... up to the prompt's end


def test_a_hit_keeps_the_window_s_end_and_leaves_one_token_to_compute():
    ctx = max_context(300)
    view = MaxContextView(ctx)
    assert view.active_idx_after_skip(256) == 300
    with pytest.raises(ValueError, match="at least one must stay"):
        view.active_idx_after_skip(300)
    view.skip_cached_prefix(256)
    assert (ctx.tokens.processed_length, ctx.tokens.active_length) == (256, 44)


def test_a_hit_past_a_chunk_max_already_cut_moves_the_window_to_the_rest_of_the_prompt():
    ctx = max_context(600)
    ctx.tokens.chunk(128)  # MAX's own manager would refuse a skip past it
    view = MaxContextView(ctx)
    assert view.active_idx == 128
    assert view.active_idx_after_skip(512) == 600
    view.skip_cached_prefix(512)
    assert (ctx.tokens.processed_length, ctx.tokens.current_position) == (512, 600)
    assert not ctx.tokens.actively_chunked


def test_salt_lora_images_and_session_come_from_max_s_fields():
    hint = json.dumps({"session_id": "agent-7"}).encode()
    ctx = max_context(300, cache_salt="tenant-a", model_name="my-adapter", dkv_cache_hint=hint)
    view = MaxContextView(ctx, base_model_name="base")
    assert (view.cache_salt, view.lora_name, view.session_id) == (
        "tenant-a",
        "my-adapter",
        "agent-7",
    )
    assert (
        MaxContextView(max_context(3, model_name="base"), base_model_name="base").lora_name is None
    )
    assert MaxContextView(max_context(3, cache_salt="")).cache_salt == ""  # no salt, to mokv
    for bad in (b"not json", b"[1, 2]", json.dumps({"session_id": 3}).encode()):
        assert MaxContextView(max_context(3, dkv_cache_hint=bad)).session_id is None


def test_images_and_hashed_tokens_key_the_pages_they_overlap():
    from max.pipelines.context import TokenHashOverride

    pixels = np.zeros((1, 1), np.float32)
    ctx = TextAndVisionContext(
        max_length=4096,
        tokens=TokenBuffer(np.zeros(400, np.int64)),
        vision_token_ids=[0],
        images=[ImageMetadata(start_idx=10, end_idx=30, pixel_values=pixels, image_hash=77)],
        token_hash_overrides=[TokenHashOverride(token_idx=5, token_hash=99, source="audio")],
    )
    assert MaxContextView(ctx).mm_inputs == (
        MultimodalInput("audio:99", 5, 1),
        MultimodalInput("image:77", 10, 20),
    )
    # MAX lets a hashed token fall inside an image: one key over both, naming each part.
    ctx.token_hash_overrides.append(TokenHashOverride(token_idx=12, token_hash=5, source="x"))
    assert MaxContextView(ctx).mm_inputs == (
        MultimodalInput("audio:99", 5, 1),
        MultimodalInput("image:77@0/20+x:5@2/1", 10, 20),
    )
