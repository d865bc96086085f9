"""What one paged replica is made of, built from `KVCacheParams`: its cache groups (and,
with groups, the budget they share), its recurrent state, its prefix chains, each
group's tiers, the joint prefix hit, its sessions and its pins (`build_replica_parts`).

The parts are wired here too, so that the replica (`replica.py`) only drives them: a
recurrent state's checkpoint leaves with its boundary's pages (`PagePool.on_evict`),
and a pool whose pinned pages a host tier holds too may spill them (`PagePool.spill`).

All or nothing. Some parts run threads: the shared tier's stores (each a writer
thread), the recurrent state's stores in it (`groups/state_shared.py`) and the tiers'.
A failure anywhere in the build -- bad input found late, a `MemoryError`, a
`KeyboardInterrupt` -- closes every part opened before it, in reverse order, and
raises: no thread outlives a constructor that raised (the manager closes the replicas
built before, `PagedKVCacheManager.__init__`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from max.driver import Buffer, Device
from max.dtype import DType

from ...cache.cache_memory import cache_buffer
from ...cache.hashing import PageHashFn
from ...cache.page_pool import PagePool
from ...config.params import KVCacheParams
from ...registry import BUILDERS
from ...remote.layout import group_key
from ...tiers.stack import TierStack
from ...undo import UndoLog
from .group_tiers import build_group_tiers, host_checkpoint_capacity
from .groups import FullAttentionGroup, JointGroups, SharedBudget, build_group
from .groups.state import RecurrentStateGroup
from .groups.state_host import HostCheckpoints
from .groups.state_shared import shared_checkpoints
from .inputs import ceil_div
from .pins import PinTable
from .prefix import PrefixChains
from .sessions import SessionTable
from .sizing import SlotGeometry
from .window_tails import TailRule


@dataclass
class ReplicaParts:
    """One replica's parts (see the module docstring); the replica names each."""

    groups: list[FullAttentionGroup]
    """The cache groups, in `params.cache_groups` order (one without groups)."""
    budget: SharedBudget | None
    """The memory every group shares (`groups/budget.py`), with groups; else None."""
    states: RecurrentStateGroup | None
    """The state layers' live blocks and checkpoints (`groups/state.py`), if any."""
    chains: PrefixChains
    """The first group's prefix lookups (`prefix.py`)."""
    group_tiers: list[TierStack]
    """Each group's tiers (`group_tiers.py`; empty stacks without `params.tiers`)."""
    joint: JointGroups | None
    """The joint prefix hit of a cache of groups or a window (`groups/joint.py`)."""
    sessions: SessionTable | None
    pins: PinTable | None
    params: KVCacheParams
    devices: list[Device]
    """The replica's devices (they split the KV heads)."""
    max_requests: int
    max_seq_len: int
    undo: UndoLog


def build_replica_parts(
    params: KVCacheParams,
    num_pages: Sequence[int],
    max_requests: int,
    max_seq_len: int,
    num_layers: int,
    devices: list[Device],
    hash_fn: PageHashFn,
    root_hash: int,
    undo: UndoLog,
    slots: SlotGeometry | None = None,
) -> ReplicaParts:
    """The parts of a replica of `max_requests` requests on `devices` (its devices split
    the KV heads): group `g` on `num_pages[g]` pages, or, with groups, on views of one
    budget of `slots`. Closes what it opened before it raises."""
    opened: list[Callable[[], None]] = []  # the close of each part that runs threads
    try:
        # `num_pages[g]` pages for group `g`, or, with groups, views of one budget's slabs
        # (every slot's values, then every slot's scales of scaled pages: `sizing.py`).
        slabs: list[Buffer] = []
        scale_slabs: list[Buffer] = []
        if slots is not None:
            num_pages = [slots.num_slots * r for r in slots.ratios]
            values = slots.num_slots * slots.value_bytes
            for d in devices:
                slab = cache_buffer(DType.uint8, [slots.num_slots * slots.slot_bytes], d)
                if slots.scale_bytes:  # views of the two regions (slices of one buffer)
                    slabs.append(slab[:values])
                    scale_slabs.append(slab[values:])
                else:
                    slabs.append(slab)
        max_pages_per_seq = ceil_div(max_seq_len, params.page_size)
        groups = [
            build_group(
                params,
                config,
                index,
                pages,
                devices,
                max_requests,
                max_pages_per_seq,
                undo,
                slabs,
                scale_slabs,
            )
            for index, (config, pages) in enumerate(zip(params.cache_groups(num_layers), num_pages))
        ]
        pools = [g.pool for g in groups]
        chains = PrefixChains(params, pools[0], hash_fn, root_hash, max_seq_len)
        budget = None
        if slots is not None:
            budget = SharedBudget(pools, slots.ratios, slots.num_slots)
            budget.undo = undo
        states = _state_group(params, num_layers, devices, max_requests, undo, opened)
        if states is not None:  # a checkpoint leaves with its boundary's pages
            for pool in pools:
                pool.on_evict = partial(states.boundaries_evicted, pools)
        group_tiers = _group_tiers(params, num_layers, groups, undo)
        opened.extend(stack.close for stack in group_tiers)
        joint = None
        if params.is_hybrid:
            tiers = group_tiers if group_tiers[0] else None
            joint = JointGroups(groups, chains, undo, tiers, budget, states)
        # Sessions and pins hold whole chains in a full group, tails in a window's, and each
        # chain's checkpoint; a share of a pool in the budget is of its part of it.
        held_in: list[tuple[PagePool, TierStack, int | TailRule]] = [
            (g.pool, stack, g.pages_in_window) for g, stack in zip(groups, group_tiers)
        ]
        if states is not None and states.config.num_checkpoints:
            held_in.append(states.held_in(params))
        shared = pools if budget is not None else []
        sessions: SessionTable | None = (
            BUILDERS.build(params.sessions, held_in, undo, shared) if params.sessions else None
        )
        pins: PinTable | None = (
            BUILDERS.build(params.pins, held_in, undo, shared) if params.pins else None
        )
        if pins is not None:  # a pinned page a host tier holds pinned too may leave the device
            for group, stack in zip(groups, group_tiers):
                if stack.keeps_pins:
                    group.pool.spill = stack.holds_pinned
        return ReplicaParts(
            groups,
            budget,
            states,
            chains,
            group_tiers,
            joint,
            sessions,
            pins,
            params,
            devices,
            max_requests,
            max_seq_len,
            undo,
        )
    except BaseException:
        for close in reversed(opened):
            close()
        raise


def _state_group(
    params: KVCacheParams,
    num_layers: int,
    devices: list[Device],
    max_requests: int,
    undo: UndoLog,
    opened: list[Callable[[], None]],
) -> RecurrentStateGroup | None:
    """The recurrent state's group (None without `params.recurrent`), its checkpoints'
    host tier and shared stores; the stores' close in `opened` from when they open (the
    group's own `close` closes them too)."""
    if params.recurrent is None:
        return None
    capacity = host_checkpoint_capacity(params, num_layers)
    host = HostCheckpoints(capacity, undo) if capacity else None
    shared = shared_checkpoints(params, len(devices))
    if shared is not None:
        opened.append(shared.close)
    return RecurrentStateGroup(
        params.recurrent, params.page_size, devices, max_requests, undo, host, shared
    )


def _group_tiers(
    params: KVCacheParams,
    num_layers: int,
    groups: list[FullAttentionGroup],
    undo: UndoLog,
) -> list[TierStack]:
    """Each group's tiers: one stack per group with groups (`build_group_tiers`), else
    the one group's, over all its layers."""
    if params.is_hybrid:
        return build_group_tiers(
            params,
            num_layers,
            [
                (g.pool, g.blocks, group_key(g.kind, g.index, g.window_size), g.scales)
                for g in groups
            ],
            undo,
        )
    group = groups[0]
    return [
        TierStack(params.tiers, params, num_layers, group.pool, group.blocks, undo, group.scales)
    ]
