"""The cache groups of a paged replica: sets of layers whose caches are written in
lockstep, each with its own pages.

base.py     CacheGroup: what the replica asks of every group kind (the protocol)
full.py     FullAttentionGroup: layers that read every token before them
sliding.py  SlidingWindowGroup: layers that read the last `window_size` tokens
mla.py      LatentGroup: multi-head latent attention layers, one latent per token
state.py    RecurrentStateGroup: linear-attention / state-space layers, one state per
            request, with checkpoints at page boundaries
budget.py   SharedBudget: one allocation for every group, moved to the group that
            needs it
joint.py    JointGroups: several groups (or a window) driven together, the joint
            prefix hit in one place
"""

from __future__ import annotations

from collections.abc import Sequence

from max.driver import Buffer, Device

from ....config.groups import CacheGroupConfig
from ....config.params import KVCacheParams
from ....undo import UndoLog
from .base import CacheGroup
from .budget import SharedBudget
from .full import FullAttentionGroup
from .joint import JointGroups
from .mla import LatentGroup
from .sliding import SlidingWindowGroup
from .state import RecurrentStateGroup

__all__ = [
    "CacheGroup",
    "FullAttentionGroup",
    "JointGroups",
    "LatentGroup",
    "RecurrentStateGroup",
    "SharedBudget",
    "SlidingWindowGroup",
    "build_group",
]


def build_group(
    params: KVCacheParams,
    config: CacheGroupConfig,
    index: int,
    num_pages: int,
    devices: Sequence[Device],
    max_requests: int,
    max_pages_per_seq: int,
    undo: UndoLog,
    slabs: Sequence[Buffer] = (),
    scale_slabs: Sequence[Buffer] = (),
) -> FullAttentionGroup:
    """The group of kind `config.kind`, `index`-th of its replica, on `num_pages` pages
    (views of `slabs`, if any, and of `scale_slabs` for scaled pages' scales)."""
    args = (
        params.group_params(config),
        range(config.num_layers),
        num_pages,
        devices,
        max_requests,
        max_pages_per_seq,
        undo,
    )
    if config.latent_dim is not None:
        return LatentGroup(
            *args,
            name=config.name,
            index=index,
            slabs=slabs,
            scale_slabs=scale_slabs,
            latent_dim=config.latent_dim,
            rope_dim=config.mla_head_dim - config.latent_dim,
        )
    if config.window_size is None:
        return FullAttentionGroup(
            *args, name=config.name, index=index, slabs=slabs, scale_slabs=scale_slabs
        )
    return SlidingWindowGroup(
        *args,
        name=config.name,
        index=index,
        slabs=slabs,
        scale_slabs=scale_slabs,
        window_size=config.window_size,
    )
