"""What a paged cache of several groups or a sliding window does not hold yet.

Scaled FP8 pages (the groups' shared budget of slots holds values only); refused by
name on a cache of groups, never accepted and ignored. Tiers, KV-cache events, sessions
and pins hold every group's pages (`group_tiers.py`, `EventRecorder.group_sink`,
`window_tails.py`); beside recurrent state layers `KVCacheParams` refuses them (the
state's checkpoints live on the device only).
"""

from __future__ import annotations

from ...config.params import KVCacheParams


def check_groups_supported(params: KVCacheParams, num_layers: int) -> None:
    """ValueError naming what a cache of groups does not hold yet: scaled FP8 pages; or
    groups whose layers do not add up to `num_layers`."""
    params.cache_groups(num_layers)  # raises for layers that do not add up
    if params.is_hybrid and params.quantization is not None:
        names = [g.name for g in params.groups]
        raise ValueError(
            f"mokv does not hold scaled FP8 pages (quantization={params.quantization!r}) on "
            f"a cache of groups {names} yet (their shared budget of slots holds values "
            "only): use unscaled FP8 pages, or one group"
        )
