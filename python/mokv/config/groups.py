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

Multi-head latent attention (MLA: DeepSeek V2 and V3, Kimi K2, GLM-5) caches one
compressed latent per token and layer instead of a K and a V per head: `latent_dim`
values (DeepSeek: 512, `kv_lora_rank`) followed by the `rope_dim` values of the shared
RoPE key (64, `qk_rope_head_dim`), one row of `latent_dim + rope_dim` (MAX's
`MLAKVCacheParams`, whose `head_dim` is that sum). Every device of a tensor-parallel
replica holds the whole latent (there are no heads to split), as MAX's
`KVCacheMemory.replicated` does:

    KVCacheParams(dtype, n_kv_heads=1, head_dim=576, page_size=128, groups=(
        CacheGroupConfig("mla", num_layers=27, latent_dim=512, rope_dim=64),
    ))
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
        head_dim: the group's head size; None: the params' `head_dim` (an MLA group's
            is `latent_dim + rope_dim`).
        latent_dim: an MLA group's latent width (DeepSeek's `kv_lora_rank`); None: a
            group of K and V heads.
        rope_dim: an MLA group's RoPE key width (`qk_rope_head_dim`), given with
            `latent_dim`.
    """

    name: str
    num_layers: int
    window_size: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    latent_dim: int | None = None
    rope_dim: int | None = None

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
        for field in ("n_kv_heads", "head_dim", "latent_dim", "rope_dim"):
            value = getattr(self, field)
            if value is not None and (value.__class__ is not int or not 1 <= value < 2**32):
                raise ValueError(
                    f"group {self.name!r}: {field} must be a positive int or None, got {value!r}"
                )
        if (self.latent_dim is None) != (self.rope_dim is None):
            raise ValueError(
                f"group {self.name!r}: an MLA group names both latent_dim and rope_dim, got "
                f"latent_dim={self.latent_dim!r}, rope_dim={self.rope_dim!r}"
            )
        if self.latent_dim is not None:
            self._check_mla()

    def _check_mla(self) -> None:
        """ValueError naming a setting an MLA group cannot honour: a window, heads other
        than the one latent, a head size other than `latent_dim + rope_dim`."""
        if self.window_size is not None:
            raise ValueError(
                f"group {self.name!r}: an MLA group reads every token before it; "
                f"window_size={self.window_size!r} is for a group of K and V heads"
            )
        if self.n_kv_heads not in (None, 1):
            raise ValueError(
                f"group {self.name!r}: an MLA group holds one latent per token, not "
                f"n_kv_heads={self.n_kv_heads!r} heads"
            )
        if self.head_dim not in (None, self.mla_head_dim):
            raise ValueError(
                f"group {self.name!r}: an MLA group's head_dim is latent_dim + rope_dim = "
                f"{self.mla_head_dim}, got head_dim={self.head_dim!r}"
            )

    @property
    def kind(self) -> str:
        """ "full", "sliding_window" (MAX's `KVCacheGroupId.type`) or "mla"."""
        if self.latent_dim is not None:
            return "mla"
        return "full" if self.window_size is None else "sliding_window"

    @property
    def mla_head_dim(self) -> int:
        """An MLA group's row: `latent_dim + rope_dim` values per token and layer."""
        assert self.latent_dim is not None and self.rope_dim is not None, self
        return self.latent_dim + self.rope_dim

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
