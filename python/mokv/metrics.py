"""Counters a KV cache manager keeps for its users."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVCacheMetrics:
    """Prompt-token accounting and page occupancy of a manager.

    Attributes:
        input_tokens: tokens that requests asked the cache to hold for processing:
            every token fetched for a step, plus every token found in the prefix cache.
        cache_tokens: of those, tokens found in the prefix cache (not recomputed).
        used_pages: pages owned by requests right now (all replicas).
        free_pages: pages that can be handed out right now, cached-free pages included.
    """

    input_tokens: int = 0
    cache_tokens: int = 0
    used_pages: int = 0
    free_pages: int = 0

    @property
    def cache_hit_rate(self) -> float:
        """`cache_tokens / input_tokens` (0.0 before any input)."""
        return self.cache_tokens / self.input_tokens if self.input_tokens else 0.0
