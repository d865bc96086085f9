"""The tiers of a replica of several cache groups: one `TierStack` per group.

Each group has its own pages (its pool, its buffers of its own head shape and layers),
so each has its own tiers too, over its own pool and buffers: a host tier whose host
pages have the group's page layout, and a shared tier whose keys name the group
(`mokv.remote.layout.group_key`: two groups' pages of one hash hold different layers'
tokens). The host memory (`HostTierConfig.swap_space_gb`) is split between the groups
in proportion to their bytes per page, so each group's host tier holds as many pages
(the same prefixes' worth; with a shared budget of device memory, `groups/budget.py`,
no group has a fixed share of the device's). A recurrent state's checkpoints take
their share too (`host_shares`, `groups/state_host.py`).

A page of a request's chain is found, for one group, on the device or in one of that
group's tiers (`found_in_tiers`); the joint prefix hit (`groups/joint.py`) counts a
tier's page as found, and each group then loads only the tier pages it takes of the
hit (a sliding group only its window's). So the joint hit is the longest prefix that
every group can serve from its device pages and its tiers together, where vLLM 0.33
first takes the groups' joint device hit and then asks its connector for the tokens
after it: mokv's hit is never shorter, and a group that lost one page of its window
to the host tier loads that page instead of recomputing the whole prefix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple, overload

from max.driver import Buffer

from ...cache.page_pool import PagePool
from ...config.params import KVCacheParams
from ...config.recurrent import RecurrentStateConfig
from ...config.tiers import HostTierConfig, TierConfig
from ...tiers.base import TierHit
from ...tiers.stack import PendingLoad, TierStack
from ...undo import UndoLog
from .sizing import group_bytes_per_page


class TierFind(NamedTuple):
    """A page of a chain that a group's tier holds (its device does not)."""

    tier: int
    """The tier's index in the group's stack."""
    hit: TierHit


Found = int | TierFind | None
"""Where one group finds one page of a chain: its device page, a tier's hit, or nowhere."""


def build_group_tiers(
    params: KVCacheParams,
    num_layers: int,
    groups: Sequence[tuple[PagePool, list[Buffer], str, list[Buffer] | None]],
    undo: UndoLog,
) -> list[TierStack]:
    """One `TierStack` per group (`groups`: each one's pool, buffers,
    `mokv.remote.layout.group_key` and scales of scaled pages), each with its share of
    the host memory. All or nothing: the stacks built before a failure are closed."""
    configs = params.cache_groups(num_layers)
    shares, _ = host_shares(params, num_layers)
    stacks: list[TierStack] = []
    try:
        for (pool, blocks, key, scales), config, share in zip(groups, configs, shares):
            stacks.append(
                TierStack(
                    [_share_of(tier, share) for tier in params.tiers],
                    params.group_params(config),
                    config.num_layers,
                    pool,
                    blocks,
                    undo,
                    scales,
                    group_key=key,
                )
            )
    except BaseException:
        for stack in stacks:  # their tiers may run threads
            stack.close()
        raise
    return stacks


def loads_by_group(
    loads: Sequence[PendingLoad], num_groups: int
) -> list[tuple[int, list[PendingLoad]]]:
    """`loads` by cache group (`PendingLoad.group`), in group order, each group that has
    some (all in group 0 for a replica of one group)."""
    if num_groups == 1:
        return [(0, list(loads))] if loads else []
    by_group: list[list[PendingLoad]] = [[] for _ in range(num_groups)]
    for load in loads:
        by_group[load.group].append(load)
    return [(g, group_loads) for g, group_loads in enumerate(by_group) if group_loads]


def host_shares(params: KVCacheParams, num_layers: int) -> tuple[list[float], float]:
    """The share of the host tier's memory each group's pages take, and the recurrent
    state's checkpoints (0 without state layers): in proportion to the bytes each keeps
    per page of prefix (a checkpoint, on every device of the replica, per
    `checkpoint_every` pages)."""
    page_bytes = [group_bytes_per_page(params, c) for c in params.cache_groups(num_layers)]
    state = params.recurrent
    state_bytes = 0.0
    if state is not None:
        state_bytes = checkpoint_bytes(params, state) / state.checkpoint_every
    total = sum(page_bytes) + state_bytes
    return [nbytes / total for nbytes in page_bytes], state_bytes / total


def checkpoint_bytes(params: KVCacheParams, state: RecurrentStateConfig) -> int:
    """Bytes of one checkpoint of `state` in one replica (a copy per device)."""
    return state.bytes_per_state * (params.n_devices // params.data_parallel_degree)


def host_checkpoint_capacity(params: KVCacheParams, num_layers: int) -> int:
    """Checkpoints one replica's host tier keeps (`groups/state_host.py`): its share of
    the host tier's memory, 0 without a host tier."""
    host = next((t for t in params.tiers if isinstance(t, HostTierConfig)), None)
    state = params.recurrent
    if host is None or state is None:
        return 0
    _, share = host_shares(params, num_layers)
    replica_bytes = host.swap_space_gb * 2**30 / params.data_parallel_degree
    return int(replica_bytes * share // checkpoint_bytes(params, state))


def _share_of(config: TierConfig, share: float) -> TierConfig:
    """`config` for a group of `share` of the groups' bytes per page (a host tier's
    memory is split in that proportion; other tiers have no fixed size)."""
    if isinstance(config, HostTierConfig):
        return dataclasses.replace(config, swap_space_gb=config.swap_space_gb * share)
    return config


def found_in_tiers(
    stack: TierStack, chain: Sequence[tuple[int, bytes]], found: list[Found], window: int
) -> Sequence[Found]:
    """`found` (a group's device page of each page of `chain`, None where it has none)
    with the pages its tiers hold filled in, tier after tier. A group that needs every
    page up to a hit (`window` 0) has its tiers continue the device's run, as a replica
    of one group does (`ReservationPlanner.plan_hits`); a sliding group's tiers are asked
    only for the pages the joint hit's rule reads (`WindowPages`). Changes nothing but
    the tiers' lookup counters."""
    if window:
        return WindowPages(stack, chain, found, window)
    out = list(found)
    pos = next((i for i, page in enumerate(out) if page is None), len(out))
    for index, tier in enumerate(stack):
        if pos >= len(out):
            break
        hits = tier.lookup(iter(chain[pos:]))
        out[pos : pos + len(hits)] = [TierFind(index, hit) for hit in hits]
        pos += len(hits)
    return out


class WindowPages(Sequence[Found]):
    """A sliding group's pages of a chain whose tiers are asked lazily: reading a page
    the device lacks asks each tier for the window of pages ending at it (the pages
    `window_hit` reads next, from the candidate end down), one lookup per tier and run
    of missing pages. So a long prompt's hit reads its last window from a tier, not the
    whole prefix (which the group would not load)."""

    def __init__(
        self,
        stack: TierStack,
        chain: Sequence[tuple[int, bytes]],
        device: list[Found],
        window: int,
    ) -> None:
        self._stack = stack
        self._chain = chain
        self._pages = list(device)
        self._asked = [page is not None for page in device]
        self._window = window

    def __len__(self) -> int:
        return len(self._pages)

    @overload
    def __getitem__(self, i: int) -> Found: ...

    @overload
    def __getitem__(self, i: slice) -> list[Found]: ...

    def __getitem__(self, i: int | slice) -> Found | list[Found]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not self._asked[i]:
            self._ask(max(0, i - self._window + 1), i + 1)
        return self._pages[i]

    def _ask(self, lo: int, hi: int) -> None:
        """Asks each tier, in order, for the pages in `[lo, hi)` not yet found."""
        pages, chain = self._pages, self._chain
        for index, tier in enumerate(self._stack):
            i = lo
            while i < hi:
                if pages[i] is not None:
                    i += 1
                    continue
                end = i
                while end < hi and pages[end] is None:
                    end += 1
                hits = tier.lookup(iter(chain[i:end]))
                pages[i : i + len(hits)] = [TierFind(index, hit) for hit in hits]
                i += len(hits) + 1  # past the page this tier lacks (or the run's end)
        self._asked[lo:hi] = [True] * (hi - lo)
