"""Counters a KV cache manager keeps for its users."""

from __future__ import annotations

from dataclasses import astuple, dataclass, field
from typing import Any, TypeVar

_S = TypeVar("_S", bound="Summed")


class Summed:
    """Counters (a dataclass of numbers) that two replicas' add up field by field."""

    def __add__(self: _S, other: _S) -> _S:
        values = zip(astuple(self), astuple(other))  # type: ignore[call-overload]
        summed: Any = type(self)
        return summed(*(a + b for a, b in values))


@dataclass
class TierMetrics(Summed):
    """One cache tier's counters, all replicas together (see `mokv.tiers`).

    Attributes:
        cache_tokens: of the manager's `cache_tokens`, tokens this tier supplied.
        used_pages: the tier's pages holding a committed prefix (0 where the tier
            cannot know, as for a shared server).
        total_pages: the tier's pages (0 where it has no fixed size).
        bytes_stored: page bytes written into the tier.
        bytes_loaded: page bytes loaded from the tier into device pages.
        evicted_unused_pages: pages the tier evicted before any request loaded them back
            (copies that cost a write and saved nothing; 0 where the tier cannot know,
            as for a shared server, which evicts by itself).
        kept_pages: of `used_pages`, pages an open session retains (`mokv.SessionConfig`).
        evicted_retained_pages: pages the tier evicted while an open session retained
            them (nothing else was left to evict).
    """

    cache_tokens: int = 0
    used_pages: int = 0
    total_pages: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    evicted_unused_pages: int = 0
    kept_pages: int = 0
    evicted_retained_pages: int = 0


@dataclass
class SessionMetrics(Summed):
    """The sessions' counters, all replicas together (`mokv.SessionConfig`).

    Attributes:
        sessions: open sessions (a session open on two replicas counts twice).
        retained_pages: distinct page hashes the open sessions retain (what
            `max_share` bounds), wherever their pages are.
        kept_pages: device pages without an owner held for a session (plain LRU would
            evict them before now).
        kept_host_pages: host-tier pages held for a session.
        turns: requests that resumed an open session (re-admissions after a preemption
            included).
        turn_hits: of `turns`, those that found at least one page cached.
        turn_prompt_tokens: prompt tokens of `turns`.
        turn_cache_tokens: of those, tokens found in the prefix cache.
        evicted_pages: retained pages evicted while their session was open (device and
            host tier): nothing unretained was left.
        ended: sessions ended by `end_session` (or `reset_prefix_cache`).
        expired: sessions ended by their time-to-live.
        dropped: times the share cap dropped an open session's retention.
    """

    sessions: int = 0
    retained_pages: int = 0
    kept_pages: int = 0
    kept_host_pages: int = 0
    turns: int = 0
    turn_hits: int = 0
    turn_prompt_tokens: int = 0
    turn_cache_tokens: int = 0
    evicted_pages: int = 0
    ended: int = 0
    expired: int = 0
    dropped: int = 0

    @property
    def turn_hit_rate(self) -> float:
        """`turn_cache_tokens / turn_prompt_tokens`: how much of a session's next turn the
        cache supplied (0.0 before any turn)."""
        return self.turn_cache_tokens / self.turn_prompt_tokens if self.turn_prompt_tokens else 0.0


@dataclass
class CacheControlMetrics(Summed):
    """Pins and write policies, all replicas together (`mokv.CacheControl`).

    Attributes:
        pins: live pins.
        pinned_pages: distinct page hashes live pins hold (what `PinConfig.max_share`
            bounds), wherever their pages are.
        pinned_device_pages: device pages without an owner that pins hold.
        granted: pins asked for and granted, whole or in part (a refresh included).
        partial: of `granted`, those the budget cut short.
        refused: pins asked for that the budget left no page (nothing pinned).
        refreshed: times a hit on a whole pinned prefix renewed its time to live.
        expired: pins ended by their time to live.
        spilled_pages: pinned pages that left the device for the host tier holding them.
        withheld_pages: full pages a request's write policy kept out of the cache.
    """

    pins: int = 0
    pinned_pages: int = 0
    pinned_device_pages: int = 0
    granted: int = 0
    partial: int = 0
    refused: int = 0
    refreshed: int = 0
    expired: int = 0
    spilled_pages: int = 0
    withheld_pages: int = 0


_NO_TIER = TierMetrics()


def _tier_counter(tier: str, counter: str, doc: str) -> property:
    """A read-only property: `counter` of `self.tiers[tier]`, 0 without that tier."""
    return property(lambda self: getattr(self.tiers.get(tier, _NO_TIER), counter), doc=doc)


def prompt_tokens_in(start: int, stop: int, prompt_end: int) -> int:
    """Of the tokens `[start, stop)` a step processes, those before `prompt_end` (the
    prompt's; a decode step's token comes after it)."""
    return max(0, min(stop, prompt_end) - start)


@dataclass
class KVCacheMetrics:
    """Prompt-token accounting and page occupancy of a manager, with MAX's meanings.

    Attributes:
        input_tokens: prompt tokens that requests' steps computed (prefix-cache misses;
            generated tokens fed back in decode steps are not counted).
        cache_tokens: prompt tokens found in the prefix cache (not recomputed).
        used_pages: pages owned by requests right now (all replicas).
        free_pages: pages that can be handed out right now, cached-free pages included.
        tiers: the lower tiers' counters by tier name ("host", "remote"), in lookup
            order; empty without tiers. The `host_*` and `remote_*` properties read them.
        sessions: the sessions' counters (all zero without `KVCacheParams.sessions`).
        cache_control: pins' and write policies' counters (`mokv.CacheControl`).
    """

    input_tokens: int = 0
    cache_tokens: int = 0
    used_pages: int = 0
    free_pages: int = 0
    tiers: dict[str, TierMetrics] = field(default_factory=dict)
    sessions: SessionMetrics = field(default_factory=SessionMetrics)
    cache_control: CacheControlMetrics = field(default_factory=CacheControlMetrics)

    @property
    def prompt_tokens(self) -> int:
        """`input_tokens + cache_tokens`: every prompt token, computed or found."""
        return self.input_tokens + self.cache_tokens

    @property
    def cache_hit_rate(self) -> float:
        """`cache_tokens / prompt_tokens`: the fraction of prompt tokens found in the
        prefix cache (0.0 before any prompt)."""
        prompt_tokens = self.prompt_tokens
        return self.cache_tokens / prompt_tokens if prompt_tokens else 0.0

    @property
    def device_cache_tokens(self) -> int:
        """Of `cache_tokens`, tokens found in device pages (no tier supplied them)."""
        return self.cache_tokens - sum(t.cache_tokens for t in self.tiers.values())

    @property
    def cache_tokens_by_source(self) -> dict[str, int]:
        """`cache_tokens` by where they were found: "device", then each tier by name
        ("host", "remote") in lookup order; the values add up to `cache_tokens`."""
        by_tier = {name: tier.cache_tokens for name, tier in self.tiers.items()}
        return {"device": self.device_cache_tokens, **by_tier}

    # MAX's flat names of the host and shared tiers' counters (0 without the tier).
    host_cache_tokens = _tier_counter(
        "host", "cache_tokens", "Of `cache_tokens`, tokens loaded from the host tier."
    )
    host_used_pages = _tier_counter(
        "host", "used_pages", "Host-tier pages holding a committed prefix (all replicas)."
    )
    host_total_pages = _tier_counter("host", "total_pages", "Host-tier pages.")
    bytes_to_host = _tier_counter("host", "bytes_stored", "Bytes written through to the host tier.")
    bytes_from_host = _tier_counter("host", "bytes_loaded", "Bytes loaded back from the host tier.")
    host_evicted_unused_pages = _tier_counter(
        "host", "evicted_unused_pages", "Host pages evicted before any request loaded them back."
    )
    remote_cache_tokens = _tier_counter(
        "remote",
        "cache_tokens",
        "Of `cache_tokens`, tokens loaded from the shared (Redis) "
        "tier; the stores' own counters are `PagedKVCacheManager.remote_metrics`.",
    )
    bytes_from_remote = _tier_counter(
        "remote", "bytes_loaded", "Page bytes loaded from the shared tier into device pages."
    )
