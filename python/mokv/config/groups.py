"""CacheGroupConfig: one group of a model's layers whose caches are written in lockstep
(`KVCacheParams.groups`; the paged manager's `managers/paged/groups/`).

A model with one kind of attention has one group: every layer reads every token before
it, and `KVCacheParams.groups` stays empty. A hybrid model (Gemma 3 and 4, GPT-OSS,
Olmo 3: five sliding-window layers to one global layer, or one to one) names its groups,
each with its own layers, its own pages and, where they differ, its own head shape:

    KVCacheParams(dtype, n_kv_heads=8, head_dim=128, page_size=128, groups=(
        CacheGroupConfig("sliding_attention", num_layers=20, window_size=1024),
        CacheGroupConfig("full_attention", num_layers=4),
    ))

The order of the groups is the order of their inputs at the graph boundary (MAX's
`MultiKVCacheParams` children come in the same order). A layer's index inside its group
is the `layer_idx` its attention op takes, as MAX's hybrid models number them.

`window_size` is MAX's (`max.nn.kv_cache.KVCacheGroupId`): it counts the query token, so
a query at position `p` reads the keys at `p - window_size + 1 .. p`; a window of 1 reads
no history and is refused, as MAX refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheGroupConfig:
    """One group of layers (see the module docstring).

    Attributes:
        name: the group's name, unique among the groups (MAX's child key, e.g.
            "sliding_attention"); it names the group's graph dims and metrics.
        num_layers: layers in the group (> 0).
        window_size: tokens a query reads, itself included (> 1); None: every token
            before it (a full-attention group).
        n_kv_heads: the group's KV heads; None: the params' `n_kv_heads`.
        head_dim: the group's head size; None: the params' `head_dim`.
    """

    name: str
    num_layers: int
    window_size: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(
                f"CacheGroupConfig.name must be an identifier (it names graph dims), "
                f"got {self.name!r}"
            )
        if self.num_layers.__class__ is not int or self.num_layers < 1:
            raise ValueError(
                f"group {self.name!r}: num_layers must be a positive int, got {self.num_layers!r}"
            )
        window = self.window_size
        if window is not None and (window.__class__ is not int or window < 2):
            raise ValueError(
                f"group {self.name!r}: window_size must be an int > 1 (it counts the query "
                f"token; a window of 1 reads no history) or None, got {window!r}"
            )
        for field in ("n_kv_heads", "head_dim"):
            value = getattr(self, field)
            if value is not None and (value.__class__ is not int or value < 1):
                raise ValueError(
                    f"group {self.name!r}: {field} must be a positive int or None, got {value!r}"
                )

    @property
    def kind(self) -> str:
        """ "full" or "sliding_window" (MAX's `KVCacheGroupId.type`)."""
        return "full" if self.window_size is None else "sliding_window"

    def pages_in_window(self, page_size: int) -> int:
        """Pages a query reads before its own page, at most: `ceil((window_size - 1) /
        page_size)` (MAX's `blocks_in_window`); 0 for a full group (no bound)."""
        if self.window_size is None:
            return 0
        return -(-(self.window_size - 1) // page_size)


def check_groups(groups: tuple[CacheGroupConfig, ...]) -> None:
    """TypeError / ValueError naming the first group that is not a `CacheGroupConfig`,
    or a name used twice."""
    names: set[str] = set()
    for group in groups:
        if not isinstance(group, CacheGroupConfig):
            raise TypeError(f"groups holds {group!r}; a group is a mokv.CacheGroupConfig")
        if group.name in names:
            raise ValueError(f"groups holds two groups named {group.name!r}")
        names.add(group.name)
