"""Cache control for clients: pinned prefixes with a time to live (`PinConfig`, the
replica's budget for them) and what one request may write into the cache
(`CacheControl`, carried by the request's context as `ctx.cache_control`).

What API users ask serving systems for (Anthropic's `cache_control` blocks, SGLang's
pinned prefixes with `SGLANG_HICACHE_MAX_PINNED_RATIO`, vLLM's and LMCache's per-request
store policies): keep *this* prefix, for *this* long; and let a batch job read the cache
without pushing an owner's idle conversation out of it.

A pin holds the pages of a prefix (by hash, `managers/paged/pins.py`): while it lives
they are never evicted from the device, or, with a host tier, leave the device only for
the host tier, which keeps them until the pin ends. A hit on the whole pinned prefix
refreshes its time to live. All pins of a replica hold at most `PinConfig.max_share` of
its device pages; a pin past that is granted for the prefix that fits, and says so.
Expiry is lazy (checked at the replica's next reservation, release or pin; until then
the metrics still count the pin) and exact to `clock`: a pin made at `t` with `ttl_s`
lives while `clock() < t + ttl_s`.

Write policies (`CacheControl.write`):

    "all"         every full page the request computes becomes a prefix (today's)
    "prefix"      only its first `write_limit_tokens` tokens (whole pages) do
    "read_only"   none: the request uses hits, and its own pages are freed unhashed

A page a policy keeps out of the device index never reaches a tier either (the host and
shared tiers store what the device commits), and is counted
(`KVCacheMetrics.withheld_pages`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .base import ParamsView, check_clock, check_share

WRITE_POLICIES = ("all", "prefix", "read_only")
"""`CacheControl.write`'s values."""

DEFAULT_PIN_SHARE = 0.5
"""Half of a replica's device pages, as `SessionConfig.max_share`: at least half keep
plain LRU order for everything unpinned."""


def _is_seconds(value: object) -> bool:
    return value.__class__ in (int, float) and not math.isnan(value) and value > 0


@dataclass(frozen=True)
class PinConfig:
    """Let requests pin prefixes (`CacheControl.pin_ttl_s`; paged strategy, needs
    `enable_prefix_caching`).

    Attributes:
        max_share: most of each replica's device pages that pins may hold, in (0, 1].
        clock: seconds, monotonic (tests inject their own); not compared.
    """

    max_share: float = DEFAULT_PIN_SHARE
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_share("PinConfig", self.max_share)
        check_clock("PinConfig", self.clock)

    def check(self, params: ParamsView) -> None:
        """ValueError unless `params` can carry pins."""
        if not params.enable_prefix_caching:
            raise ValueError("PinConfig needs enable_prefix_caching: pins hold prefix pages")

    def cap(self, num_pages: int) -> int:
        """Most pages pins may hold in a replica of `num_pages` device pages."""
        return int(self.max_share * num_pages)


@dataclass(frozen=True)
class CacheControl:
    """What one request asks of the cache (`ctx.cache_control`).

    Attributes:
        pin_ttl_s: pin the request's prefix for this many seconds when it is released
            (> 0; None: no pin). Needs `KVCacheParams.pins`.
        pin_tokens: how many leading tokens to pin (whole pages of them); None: every
            page the request committed or found.
        write: "all", "prefix" or "read_only" (see the module docstring).
        write_limit_tokens: with "prefix", the leading tokens that may become prefixes
            (>= 0); None otherwise.
    """

    pin_ttl_s: float | None = None
    pin_tokens: int | None = None
    write: str = "all"
    write_limit_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.pin_ttl_s is not None and not _is_seconds(self.pin_ttl_s):
            raise ValueError(
                f"CacheControl.pin_ttl_s must be a number of seconds > 0 or None, "
                f"got {self.pin_ttl_s!r}"
            )
        tokens = self.pin_tokens
        if tokens is not None and (tokens.__class__ is not int or tokens < 0):
            raise ValueError(f"CacheControl.pin_tokens must be an int >= 0 or None, got {tokens!r}")
        if self.write not in WRITE_POLICIES:
            raise ValueError(
                f"CacheControl.write must be one of {WRITE_POLICIES}, got {self.write!r}"
            )
        limit = self.write_limit_tokens
        if (self.write == "prefix") != (limit is not None):
            raise ValueError(
                f"CacheControl.write_limit_tokens goes with write='prefix' (and only with it), "
                f"got write={self.write!r}, write_limit_tokens={limit!r}"
            )
        if limit is not None and (limit.__class__ is not int or limit < 0):
            raise ValueError(f"CacheControl.write_limit_tokens must be an int >= 0, got {limit!r}")

    def write_limit_pages(self, page_size: int) -> float:
        """How many leading pages the request may commit (`math.inf`: every one)."""
        if self.write == "read_only":
            return 0
        if self.write == "prefix":
            return self.write_limit_tokens // page_size  # type: ignore[operator]
        return math.inf
