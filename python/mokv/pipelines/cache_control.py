"""Cache control over HTTP (`mokv serve`): a request's pin and write policy, carried from
the HTTP body to the model worker in MAX's per-request KV-cache hint, and the `usage`
fields that report what the request read from and wrote to the cache.

    the request sends                                     mokv does (`mokv.CacheControl`)
    dkv_cache_hint {"cache_control": {"type":             pins the prompt's full pages at
      "ephemeral", "ttl": "5m" | "1h"}}                     its release, for 5 min / 1 h
    a chat message with "cache_control" (Anthropic's      the same (the last marked one
      shape, on the message or a content part)              wins over the hint's)
    dkv_cache_hint {"write_policy": "all" |               what the request may write
      "read_only" | {"prefix_tokens": N}}                   (`CacheControl.write`)

A completions request with token ids has no messages: its cache control rides in
`dkv_cache_hint` (`extra_body={"dkv_cache_hint": {...}}` with the `openai` client).
A marked chat message pins the whole prompt the request sends, not only the prefix
through that message (mokv does not render part of a conversation). MAX's chat
request schema keeps a message's unknown fields (`extra="allow"`), so `cache_control`
reaches the tokenizer, where `carry` reads it.

`carry` runs in the API server (`mokv serve`'s tokenizer): it checks the hint and the
messages (a bad value is MAX's `InputError`, HTTP 400, naming it; a pin asked of a server
without `pins` in `--mokv-config` too), writes the resolved hint onto the context (the
JSON bytes MAX hands to the worker, where `MaxContextView.cache_control` reads it with
`cache_control_of`), and notes for the usage what the request may write. The usage of
each response MAX's OpenAI routes build (`with_cache_usage`: `seams.install_usage`)
then carries, as Anthropic's API reports them:

    cache_read_input_tokens       prompt tokens found in the cache (`cached_tokens`)
    cache_creation_input_tokens   prompt tokens of the full pages the request wrote to
                                  the cache (within its write policy), less those read
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..config.cache_control import CacheControl

TTL_S = {"5m": 300.0, "1h": 3600.0}
"""Anthropic's `cache_control.ttl` values, in seconds ("5m" when none is given)."""


def _pin_ttl_s(value: object) -> float:
    if not isinstance(value, Mapping) or value.get("type") != "ephemeral":
        raise ValueError(f'cache_control must be {{"type": "ephemeral", ...}}, got {value!r}')
    unknown = sorted(set(value) - {"type", "ttl"})
    if unknown:
        raise ValueError(f"cache_control has unknown key(s) {unknown}")
    ttl = value.get("ttl", "5m")
    if ttl not in TTL_S:
        raise ValueError(f"cache_control.ttl must be one of {sorted(TTL_S)}, got {ttl!r}")
    return TTL_S[ttl]


def cache_control_of(hint: object) -> CacheControl | None:
    """The `CacheControl` a KV-cache hint (a parsed JSON object) asks for, None if it
    asks for none; ValueError naming a bad value."""
    if not isinstance(hint, Mapping):
        return None
    pin = hint.get("cache_control")
    policy = hint.get("write_policy", "all")
    if pin is None and policy == "all":
        return None
    ttl_s = _pin_ttl_s(pin) if pin is not None else None
    if isinstance(policy, Mapping) and set(policy) == {"prefix_tokens"}:
        return CacheControl(ttl_s, write="prefix", write_limit_tokens=policy["prefix_tokens"])
    if policy not in ("all", "read_only"):
        raise ValueError(
            f'write_policy must be "all", "read_only" or {{"prefix_tokens": N}}, got {policy!r}'
        )
    return CacheControl(ttl_s, write=policy)


def marked_cache_control(messages: Sequence[Any] | None) -> Any:
    """The `cache_control` of the last chat message (or content part) that has one."""
    marked = None
    for message in messages or ():
        if not isinstance(message, Mapping):
            continue
        parts = message.get("content")
        for part in [message, *(parts if isinstance(parts, list) else ())]:
            if isinstance(part, Mapping) and part.get("cache_control") is not None:
                marked = part["cache_control"]
    return marked


@dataclass(frozen=True)
class RequestWrites:
    """What one request may write to the cache, for its usage."""

    page_size: int
    limit_tokens: int | None
    """The most prompt tokens it may write (None: every full page)."""


MAX_NOTED = 4096
"""Requests whose `RequestWrites` wait for their usage; past it the oldest is dropped (a
request that failed before its usage was built)."""

_WRITES: OrderedDict[str, RequestWrites] = OrderedDict()
"""Request id -> what it may write, from `carry` to its response's usage (both run in the
API server's event loop)."""


def carry(request: Any, context: Any, page_size: int, pins: bool) -> None:
    """Checks the request's cache control and writes it onto MAX's `context` (see the
    module docstring); ValueError naming a bad value."""
    hint = dict(getattr(request, "dkv_cache_hint", None) or {})
    marked = marked_cache_control(getattr(request, "messages", None))
    if marked is not None:
        hint["cache_control"] = marked
    control = cache_control_of(hint)
    if control is not None and control.pin_ttl_s is not None and not pins:
        raise ValueError(
            "cache_control asks for a pin, but this server pins nothing: add a `pins` "
            "section to --mokv-config"
        )
    if marked is not None:
        context.dkv_cache_hint = json.dumps(hint).encode()
    limit = None
    if control is not None and control.write != "all":
        limit = page_size * int(control.write_limit_pages(page_size))
    request_id = getattr(request, "request_id", None)
    if request_id is not None:
        _WRITES[str(request_id)] = RequestWrites(page_size, limit)
        if len(_WRITES) > MAX_NOTED:
            _WRITES.popitem(last=False)


def count_cache_tokens(request_id: str, usage: Any) -> None:
    """Adds Anthropic's two counters to `usage` (openai's `CompletionUsage`: extra fields,
    which a field typed as it serializes) for the request `carry` noted."""
    details = getattr(usage, "prompt_tokens_details", None)
    read = getattr(details, "cached_tokens", None) or 0
    writes = _WRITES.pop(request_id, None)
    created = 0
    if writes is not None:
        written = usage.prompt_tokens // writes.page_size * writes.page_size
        if writes.limit_tokens is not None:
            written = min(written, writes.limit_tokens)
        created = max(0, written - read)
    usage.cache_read_input_tokens = read
    usage.cache_creation_input_tokens = created


def with_cache_usage(base: type) -> type:
    """A subclass of one of MAX's OpenAI response models (`base`: `id` and `usage`
    fields) whose usage, when it has one, carries the cache counters
    (`count_cache_tokens`)."""

    class WithCacheUsage(base):
        def __init__(self, **fields: Any) -> None:
            if fields.get("usage") is not None:
                count_cache_tokens(str(fields.get("id")), fields["usage"])
            super().__init__(**fields)

    WithCacheUsage.__name__ = WithCacheUsage.__qualname__ = base.__name__
    return WithCacheUsage
