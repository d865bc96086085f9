"""LatentGroup: multi-head latent attention (MLA) layers, whose cache is one compressed
latent per token and layer (DeepSeek V2 and V3, Kimi K2, GLM-5).

Its pages hold the latents of every layer of the group (`blocks`, one buffer per
device: `[num_pages, 1, num_layers, page_size, 1, latent_dim + rope_dim]`, MAX 26.7's
MLA block): a row is the `latent_dim` values of the compressed KV (the keys and values
of every head are its up-projections) followed by the `rope_dim` values of the RoPE key
all heads share. Each layer's query reads every token before it, so the group's pages,
prefix hits, commits and releases are a full group's (`FullAttentionGroup`); only the
page's contents differ, and `kv_dim` (1) and `n_kv_heads_per_device` (1) of its params
say so to the layouts, the tiers and the sizing.

Tensor parallelism splits an MLA layer's query heads, not its cache: every device of
a replica computes and writes the same latent, so each holds a whole copy (MAX's
`KVCacheMemory.replicated`), and a replica's bytes per page count it once per device
(`KVCacheParams.bytes_per_token`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from .full import FullAttentionGroup


class LatentGroup(FullAttentionGroup):
    """A `FullAttentionGroup` whose pages hold a latent of `latent_dim` and a RoPE key
    of `rope_dim` per token and layer (params of `kv_dim` 1, one head of their sum)."""

    kind: ClassVar[str] = "mla"

    def __init__(self, *args: Any, latent_dim: int, rope_dim: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.latent_dim = latent_dim
        self.rope_dim = rope_dim
