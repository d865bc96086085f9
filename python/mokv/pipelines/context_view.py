"""mokv's request protocol (`mokv.TextGenerationContext`) over a MAX 26.7 request context.

MAX's scheduler and pipelines hand the KV manager their own contexts
(`max.pipelines.context.TextContext`, `TextAndVisionContext`); mokv's managers read a
request through mokv's protocol. `MaxContextView` is that protocol over MAX's token
buffer, live (nothing is copied), and carries into mokv's page keys what MAX's request
says about them:

    mokv reads      from MAX's context
    start_idx       tokens.processed_length
    active_idx      tokens.current_position, capped at start + max_num_input_tokens
                    (chunked prefill: MAX allocates a prompt one budget at a time)
    end_idx         len(tokens)
    cache_salt      cache_salt (MAX's per-tenant salt; the empty salt is no salt)
    lora_name       model_name, when it names a LoRA adapter rather than the base model
    mm_inputs       images (image_hash over [start_idx, end_idx)) and
                    token_hash_overrides (one token each), as `mokv.MultimodalInput`s
    session_id      dkv_cache_hint {"session_id": ...} (MAX's per-request KV-cache
                    hint, carried from the HTTP body to the model worker as JSON)
    cache_control   dkv_cache_hint {"cache_control": ..., "write_policy": ...}
                    (`mokv.pipelines.cache_control`)

MAX's rule when a prefix hit moves the window (`TokenBuffer.skip_processing`): the
window keeps its end and at least one token of it stays to compute. mokv's prefix match
stops one token short of the prompt's end, so a hit always leaves one; a hit past a
chunk MAX has already cut is taken by un-chunking first (`seams.unchunk`), where MAX's
own manager would raise.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..config.cache_control import CacheControl
from ..context import MultimodalInput, RequestID
from . import seams
from .cache_control import cache_control_of


class MaxContextView:
    """A MAX 26.7 `TextContext` read as mokv's `TextGenerationContext`.

    Args:
        ctx: MAX's context (`TextContext` or `TextAndVisionContext`).
        max_num_input_tokens: the most prompt tokens one forward encodes (MAX's chunked
            prefill budget), or None: a prompt is reserved whole.
        base_model_name: the served model's name: a context naming another model names
            a LoRA adapter.
    """

    __slots__ = ("ctx", "_budget", "_base_model_name")

    def __init__(
        self, ctx: Any, max_num_input_tokens: int | None = None, base_model_name: str = ""
    ) -> None:
        self.ctx = ctx
        self._budget = max_num_input_tokens
        self._base_model_name = base_model_name

    @property
    def request_id(self) -> RequestID:
        return RequestID(str(self.ctx.request_id))

    @property
    def tokens(self) -> np.ndarray:
        return np.asarray(self.ctx.tokens.all)

    @property
    def start_idx(self) -> int:
        return int(self.ctx.tokens.processed_length)

    @property
    def active_idx(self) -> int:
        return self._capped(self.start_idx, int(self.ctx.tokens.current_position))

    @property
    def end_idx(self) -> int:
        return len(self.ctx.tokens)

    @property
    def active_length(self) -> int:
        return self.active_idx - self.start_idx

    def _capped(self, start: int, end: int) -> int:
        """`end`, or where the budget from `start` ends if that comes first."""
        if self._budget is not None and start + self._budget < end:
            return start + self._budget
        return end

    @property
    def cache_salt(self) -> str | None:
        """MAX's salt as given (mokv checks its type; "" is no salt)."""
        return getattr(self.ctx, "cache_salt", None)

    @property
    def lora_name(self) -> str | None:
        name = getattr(self.ctx, "model_name", "")
        return name if name and name != self._base_model_name else None

    @property
    def mm_inputs(self) -> tuple[MultimodalInput, ...]:
        """The prompt's images and hashed tokens, by offset (mokv's image keys). MAX lets
        a hashed token fall inside an image; mokv's keys do not overlap, so overlapping
        ones become one key over their union, named by each part and its place in it."""
        keys = [
            MultimodalInput(
                f"image:{image.image_hash}", image.start_idx, image.end_idx - image.start_idx
            )
            for image in getattr(self.ctx, "images", ())
            if image.image_hash is not None
        ]
        keys += [
            MultimodalInput(f"{o.source}:{o.token_hash}", o.token_idx, 1)
            for o in getattr(self.ctx, "token_hash_overrides", ())
        ]
        merged: list[list[MultimodalInput]] = []
        for key in sorted(keys, key=lambda key: (key.offset, -key.length)):
            if merged and key.offset < max(k.end for k in merged[-1]):
                merged[-1].append(key)
            else:
                merged.append([key])
        return tuple(group[0] if len(group) == 1 else _union(group) for group in merged)

    def _hint(self) -> Any:
        """The request's `dkv_cache_hint`, parsed (None: none, or not JSON)."""
        hint = getattr(self.ctx, "dkv_cache_hint", None)
        if not hint:
            return None
        try:
            return json.loads(hint)
        except ValueError:
            return None

    @property
    def session_id(self) -> str | None:
        """The `session_id` of the request's `dkv_cache_hint` (a JSON object), if any."""
        hint = self._hint()
        session = hint.get("session_id") if isinstance(hint, dict) else None
        return session if isinstance(session, str) and session else None

    @property
    def cache_control(self) -> CacheControl | None:
        """The pin and write policy of the request's `dkv_cache_hint`, which `mokv serve`'s
        API server checked (`cache_control_of`: ValueError naming a bad one)."""
        return cache_control_of(self._hint())

    def active_idx_after_skip(self, num_tokens: int) -> int:
        """Where the window ends once the first `num_tokens` tokens are cached: MAX's
        window keeps its end (capped by the budget from the new start), so at least one
        token stays to compute; ValueError when none would."""
        start, end = self.start_idx, self.end_idx
        if not start <= num_tokens < end:
            raise ValueError(
                f"cannot skip to {num_tokens}: the request's uncached tokens are "
                f"[{start}, {end}) and at least one must stay to compute"
            )
        window_end = int(self.ctx.tokens.current_position)
        if num_tokens >= window_end:  # past a chunk MAX already cut: the rest of the prompt
            window_end = end
        return self._capped(num_tokens, window_end)

    def skip_cached_prefix(self, num_tokens: int) -> None:
        self.active_idx_after_skip(num_tokens)
        tokens = self.ctx.tokens
        if num_tokens >= tokens.current_position:  # past a chunk MAX already cut
            seams.unchunk(tokens)
        tokens.skip_processing(num_tokens - self.start_idx)

    def update(self, new_token: int) -> None:
        self.ctx.update(new_token)


def _union(keys: list[MultimodalInput]) -> MultimodalInput:
    """One key over overlapping keys' union, named by each key and its offset in it."""
    start = keys[0].offset
    end = max(key.end for key in keys)
    name = "+".join(f"{key.identifier}@{key.offset - start}/{key.length}" for key in keys)
    return MultimodalInput(name, start, end - start)
