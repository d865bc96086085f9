"""RecurrentStateConfig: the recurrent state of a hybrid model's linear-attention or
state-space layers (Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba 2), beside its
attention groups (`KVCacheParams.recurrent`; `managers/paged/groups/state.py`).

Such a layer's cache is one fixed-size state per request, not pages of tokens: each
`StateRegion` is one kind of state (a causal conv's last inputs, the SSM or delta-rule
matrix), `row_shape` per layer, as MAX's `RecurrentStateRegion` declares it:

    KVCacheParams(dtype, n_kv_heads=2, head_dim=16, page_size=128, groups=(
        CacheGroupConfig("full_attention", num_layers=1),), recurrent=RecurrentStateConfig(
        "linear_attention", regions=(
            StateRegion("conv", num_layers=3, row_shape=(128, 3), dtype=DType.float32),
            StateRegion("ssm", num_layers=3, row_shape=(4, 16, 16), dtype=DType.float32)),
        checkpoint_every=1, num_checkpoints=64))

Prefix caching keeps *checkpoints*: the state after a page boundary, taken when a step
ends on a boundary of `checkpoint_every` pages and found by the chain hash of the page
that ends there. Each checkpoint costs one whole state (`bytes_per_state`, every layer
and region); a request of `n` pages leaves up to `n // checkpoint_every` of them, and the
group holds at most `num_checkpoints`, evicting the least recently used.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from max.dtype import DType

STATE_REGION_ID = re.compile(r"[A-Za-z0-9_]{1,64}")
"""A region id the shared tier's keys can name (`mokv.remote.layout.StateLayout`): no
'.', '-', '+' or ':' that would make two keys' fingerprints ambiguous."""


@dataclass(frozen=True)
class StateRegion:
    """One kind of state: `row_shape` values of `dtype` per layer and request (per
    device: a tensor-parallel replica's devices each hold their shard of the heads).

    Attributes:
        leaf_id: the region's name, unique in its config (MAX's leaf id, e.g. "conv").
        num_layers: layers holding this state (> 0).
        row_shape: one layer's state, e.g. `(conv_dim, kernel_size - 1)`.
        dtype: the state's dtype.
    """

    leaf_id: str
    num_layers: int
    row_shape: tuple[int, ...]
    dtype: DType

    def __post_init__(self) -> None:
        if not isinstance(self.leaf_id, str) or not self.leaf_id:
            raise ValueError(f"StateRegion.leaf_id must be a non-empty str, got {self.leaf_id!r}")
        if self.num_layers.__class__ is not int or self.num_layers < 1:
            raise ValueError(
                f"region {self.leaf_id!r}: num_layers must be a positive int, "
                f"got {self.num_layers!r}"
            )
        shape = tuple(self.row_shape) if isinstance(self.row_shape, (tuple, list)) else None
        if not shape or any(d.__class__ is not int or d < 1 for d in shape):
            raise ValueError(
                f"region {self.leaf_id!r}: row_shape must be a non-empty tuple of positive "
                f"ints, got {self.row_shape!r}"
            )
        object.__setattr__(self, "row_shape", shape)
        if not isinstance(self.dtype, DType):
            raise TypeError(f"region {self.leaf_id!r}: dtype must be a DType, got {self.dtype!r}")

    @property
    def bytes_per_state(self) -> int:
        """Bytes of one request's state of this region, every layer, on one device."""
        return self.num_layers * math.prod(self.row_shape) * self.dtype.size_in_bytes


@dataclass(frozen=True)
class RecurrentStateConfig:
    """The recurrent state of a model's state layers (see the module docstring).

    Attributes:
        name: the group's name (an identifier; it names metrics and errors).
        regions: the kinds of state, in graph-input order (MAX's region order).
        checkpoint_every: pages between checkpoints (>= 1): a step ending on a boundary
            of that many pages leaves one.
        num_checkpoints: checkpoints the group holds at most (>= 0); 0 keeps none, and
            a prefix hit of the attention groups then resumes nothing (the joint hit
            is 0 pages).
    """

    name: str
    regions: tuple[StateRegion, ...]
    checkpoint_every: int = 1
    num_checkpoints: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"RecurrentStateConfig.name must be an identifier, got {self.name!r}")
        regions = tuple(self.regions) if isinstance(self.regions, (tuple, list)) else None
        if not regions or not all(isinstance(r, StateRegion) for r in regions):
            raise TypeError(
                f"recurrent state {self.name!r}: regions must be a non-empty tuple of "
                f"mokv.StateRegion, got {self.regions!r}"
            )
        ids = [r.leaf_id for r in regions]
        if len(set(ids)) != len(ids):
            raise ValueError(f"recurrent state {self.name!r}: region ids repeat: {ids}")
        object.__setattr__(self, "regions", regions)
        check_checkpoints(
            f"recurrent state {self.name!r}", self.checkpoint_every, self.num_checkpoints
        )

    @property
    def bytes_per_state(self) -> int:
        """Bytes of one request's whole state (every region) on one device: the memory
        of a running request's state, and of each checkpoint."""
        return sum(region.bytes_per_state for region in self.regions)


DEFAULT_CHECKPOINTS = 64
"""Checkpoints a served hybrid model keeps when its options name none."""


@dataclass(frozen=True)
class StateCheckpointConfig:
    """How a served hybrid model keeps its state checkpoints (`mokv.pipelines.MokvOptions`,
    the `state_checkpoints` section of `mokv serve --mokv-config`): every
    `checkpoint_every` pages, at most `num_checkpoints` (`RecurrentStateConfig`)."""

    checkpoint_every: int = 1
    num_checkpoints: int = DEFAULT_CHECKPOINTS

    def __post_init__(self) -> None:
        check_checkpoints("state_checkpoints", self.checkpoint_every, self.num_checkpoints)


def check_checkpoints(owner: str, checkpoint_every: int, num_checkpoints: int) -> None:
    """ValueError naming a `checkpoint_every` below 1 or a `num_checkpoints` below 0."""
    for field, value, least in (
        ("checkpoint_every", checkpoint_every, 1),
        ("num_checkpoints", num_checkpoints, 0),
    ):
        if value.__class__ is not int or not least <= value < 2**32:
            raise ValueError(f"{owner}: {field} must be an int >= {least}, got {value!r}")
