"""Issue 56's probe, kept: every field of every configuration and of a context gets the
same classes of bad input (wrong types, falsy ones included; bounds: negative, zero,
huge, non-finite), and each is either refused at once with a TypeError or ValueError
(mokv's errors are ValueErrors too) that names the field or the value, or accepted and
then works: a manager built with it reserves, fetches, steps and releases a request. A
secret (the Redis URL, the MAC key) is never named: its error names the field only."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import mokv
import numpy as np
import pytest
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession
from mokv.events import PrefixRouterIndex

BAD = [None, "x", "", b"", 1.5, True, False, 0, -1, 2**63, 2**64, math.inf, math.nan, 1e12,
       [], (), [1], object()]
SHAPE = dict(dtype=DType.float32, n_kv_heads=2, head_dim=8, page_size=4,
             enable_prefix_caching=True)
SECRETS = {"RemoteTierConfig.url", "RemoteTierConfig.mac_key"}
_ports = itertools.count(23000)
PIN = mokv.CacheControl(pin_ttl_s=60)


@pytest.fixture(scope="module")
def session():
    return InferenceSession(devices=[CPU()])


def _serve(params: mokv.KVCacheParams, session, ctx: mokv.TextContext | None = None) -> None:
    """One request (`ctx`, or a plain one) through a manager built on `params`: what an
    accepted value must allow."""
    m = mokv.PagedKVCacheManager(params, 2, 32, 2, [CPU()] * params.n_devices, session,
                                 16 * params.data_parallel_degree * params.bytes_per_page(2))
    try:
        ctx = ctx or mokv.TextContext(np.arange(9))
        m.external_claim(ctx.request_id)
        assert m.maybe_reserve(ctx)
        m.fetch([ctx])
        ctx.update(1)
        m.step([ctx])
        m.release(ctx.request_id)
    finally:
        m.close()


def _events(**fields) -> mokv.KVEventsConfig:
    return mokv.KVEventsConfig(**{"endpoint": f"tcp://127.0.0.1:{next(_ports)}", **fields})


def _set_later(field: str, value: object) -> mokv.TextContext:
    ctx = mokv.TextContext(np.arange(9), lora_name="adapter")
    setattr(ctx, field, value)
    return ctx


def _pin_and_route(index: object) -> None:
    """What an accepted router clock must allow: a pin noted, then a routing decision."""
    assert isinstance(index, PrefixRouterIndex)
    index.note_pin(("a", 0), np.arange(9), 60)
    index.best(np.arange(9))


FIELDS: list[tuple[str, Callable[[object], object], Callable[[object, object], None] | None]] = [
    *[(f"KVCacheParams.{f}", lambda v, f=f: mokv.KVCacheParams(**{**SHAPE, f: v}),
       lambda p, s: _serve(p, s))
      for f in ("dtype", "n_kv_heads", "head_dim", "page_size", "cache_strategy",
                "enable_prefix_caching", "prefix_hash", "prefix_hash_seed", "tiers",
                "kv_events", "sessions", "pins")],
    *[(f"HostTierConfig.{f}",
       lambda v, f=f: mokv.HostTierConfig(**{"swap_space_gb": 0.001, f: v}),
       lambda t, s: _serve(mokv.KVCacheParams(**SHAPE, tiers=(t,)), s))
      for f in ("swap_space_gb", "min_hits")],
    *[(f"SessionConfig.{f}", lambda v, f=f: mokv.SessionConfig(**{f: v}),
       lambda c, s: _serve(mokv.KVCacheParams(**SHAPE, sessions=c), s))
      for f in ("ttl_s", "max_share", "clock")],
    *[(f"PinConfig.{f}", lambda v, f=f: mokv.PinConfig(**{f: v}),
       lambda c, s: _serve(mokv.KVCacheParams(**SHAPE, pins=c), s,
                           mokv.TextContext(np.arange(9), cache_control=PIN)))
      for f in ("max_share", "clock")],
    *[(f"CacheControl.{f}",
       lambda v, f=f: mokv.CacheControl(**{**({"write": "prefix"} if f == "write_limit_tokens"
                                             else {}), f: v}),
       lambda c, s: _serve(mokv.KVCacheParams(**SHAPE, pins=mokv.PinConfig()), s,
                           mokv.TextContext(np.arange(9), cache_control=c)))
      for f in ("pin_ttl_s", "pin_tokens", "write", "write_limit_tokens")],
    *[(f"KVEventsConfig.{f}", lambda v, f=f: _events(**{f: v}),
       lambda c, s: _serve(mokv.KVCacheParams(**SHAPE, kv_events=c), s))
      for f in ("endpoint", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size",
                "topic", "payload_format", "salt_format")],
    *[(f"RemoteTierConfig.{f}",
       lambda v, f=f: mokv.RemoteTierConfig(**{"url": "redis://127.0.0.1:1/0",
                                               "namespace": "m", f: v}), None)
      for f in ("url", "namespace", "timeout_s", "mac_key")],
    *[(f"TextContext.{f}",
       lambda v, f=f: mokv.TextContext(np.arange(9), **{"lora_name": "adapter", f: v}),
       lambda c, s: _serve(mokv.KVCacheParams(**SHAPE), s, c))
      for f in ("request_id", "max_length", "cache_salt", "lora_name", "lora_id",
                "mm_inputs", "session_id", "cache_control")],
    *[(f"TextContext.{f} (set later)", lambda v, f=f: _set_later(f, v),
       lambda c, s: _serve(mokv.KVCacheParams(**SHAPE), s, c))
      for f in ("max_length", "cache_salt", "lora_name", "lora_id", "mm_inputs",
                "session_id", "cache_control")],
    *[(f"MultimodalInput.{f}",
       lambda v, f=f: mokv.MultimodalInput(**{"identifier": "i", "offset": 0, "length": 4,
                                              f: v}), None)
      for f in ("identifier", "offset", "length")],
    *[(f"PrefixRouterIndex.{f}", lambda v, f=f: PrefixRouterIndex(**{"page_size": 4, f: v}),
       lambda r, s: r.match(np.arange(9)))
      for f in ("page_size", "prefix_hash", "prefix_hash_seed", "host_weight",
                "shared_weight")],
    ("PrefixRouterIndex.clock", lambda v: PrefixRouterIndex(page_size=4, clock=v),  # type: ignore[arg-type]
     lambda r, s: _pin_and_route(r)),
]


@pytest.mark.parametrize("label,make,use", FIELDS, ids=[f[0] for f in FIELDS])
def test_every_field_refuses_bad_input_by_name_or_works(session, label, make, use):
    field = label.split(".")[1].split(" ")[0]
    for value in BAD:
        try:
            made = make(value)
        except (TypeError, ValueError) as error:
            text = str(error)
            if label in SECRETS:
                assert field in text, (label, value, text)
            else:
                assert field in text or repr(value) in text, (label, value, text)
            continue
        if use is not None:  # accepted: it must work (a typed error here is a late refusal)
            use(made, session)
