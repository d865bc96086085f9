"""What a paged cache of several groups or a sliding window does not hold yet.

Pins keep one full-attention group's pages today (`PinTable` pins the hashes of one
pool, and lets its pages spill to one host tier; a sliding group should pin only the
window before a pinned prefix's end, as its sessions retain: `window_tails.py`); on
a cache of groups they are refused by name, never accepted and ignored. Tiers, KV-cache
events and sessions hold every group's pages (`group_tiers.py`,
`EventRecorder.group_sink`, `SessionTable`).
"""

from __future__ import annotations

from ...config.params import KVCacheParams


def check_groups_supported(params: KVCacheParams, num_layers: int) -> None:
    """ValueError naming what a cache of groups does not hold yet: pins (keyed to one
    pool of pages today); or groups whose layers do not add up to `num_layers`."""
    params.cache_groups(num_layers)  # raises for layers that do not add up
    if not params.is_hybrid:
        return
    names = [g.name for g in params.groups]
    for feature, value in (("pins", params.pins),):
        if value:
            raise ValueError(
                f"mokv does not hold {feature}={value!r} on a cache of groups {names} yet "
                "(it holds one full-attention group's pages): drop it, or use one group"
            )
