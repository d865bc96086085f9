"""What a paged cache of several groups or a sliding window does not hold yet.

Tiers, sessions and KV-cache events each keep one full-attention group's pages today;
on a cache of groups they are refused by name, never accepted and ignored.
"""

from __future__ import annotations

from ...config.params import KVCacheParams


def check_groups_supported(params: KVCacheParams, num_layers: int) -> None:
    """ValueError naming what a cache of groups does not hold yet: host and shared tiers,
    sessions, KV-cache events and pins (each keyed to one pool of pages today), scaled FP8
    pages (the groups' shared budget of slots holds values only); or groups whose layers
    do not add up to `num_layers`."""
    params.cache_groups(num_layers)  # raises for layers that do not add up
    if not params.is_hybrid:
        return
    names = [g.name for g in params.groups]
    for feature, value in (
        ("tiers", params.tiers),
        ("sessions", params.sessions),
        ("kv_events", params.kv_events),
        ("pins", params.pins),
    ):
        if value:
            raise ValueError(
                f"mokv does not hold {feature}={value!r} on a cache of groups {names} yet "
                "(they hold one full-attention group's pages): drop them, or use one group"
            )
    if params.quantization is not None:
        raise ValueError(
            f"mokv does not hold scaled FP8 pages (quantization={params.quantization!r}) on "
            f"a cache of groups {names} yet (their shared budget of slots holds values "
            "only): use unscaled FP8 pages, or one group"
        )
