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
        host_cache_tokens: of `cache_tokens`, tokens loaded from the host tier (the rest
            were device hits).
        host_used_pages: host-tier pages holding a committed prefix (all replicas).
        host_total_pages: host-tier pages (0 with the tier off).
        bytes_to_host: bytes written through to the host tier.
        bytes_from_host: bytes loaded back from the host tier.
        remote_cache_tokens: of `cache_tokens`, tokens loaded from the shared (Redis)
            tier; the store's own counters are `PagedKVCacheManager.remote_metrics`.
        bytes_from_remote: page bytes loaded from the shared tier into device pages.
    """

    input_tokens: int = 0
    cache_tokens: int = 0
    used_pages: int = 0
    free_pages: int = 0
    host_cache_tokens: int = 0
    host_used_pages: int = 0
    host_total_pages: int = 0
    bytes_to_host: int = 0
    bytes_from_host: int = 0
    remote_cache_tokens: int = 0
    bytes_from_remote: int = 0

    @property
    def cache_hit_rate(self) -> float:
        """`cache_tokens / input_tokens` (0.0 before any input)."""
        return self.cache_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def device_cache_tokens(self) -> int:
        """Of `cache_tokens`, tokens found in device pages."""
        return self.cache_tokens - self.host_cache_tokens - self.remote_cache_tokens
