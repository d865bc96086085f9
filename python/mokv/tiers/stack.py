"""TierStack: one replica's tiers, in lookup order, driven as one.

The replica plans a request's hits tier by tier (`Tier.lookup` on the chain's tail, each
tier from where the one before it stopped); everything after that goes through the
stack, which hands each tier its own hits: a `PendingLoad` names its tier by index.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from max.driver import Buffer

from ..cache.extra_keys import EventKeys
from ..cache.page_pool import PagePool
from ..config.params import KVCacheParams
from ..config.tiers import TierConfig
from ..events.publisher import TierEvents
from ..metrics import TierMetrics
from ..registry import BUILDERS
from ..undo import UndoLog
from .base import (
    ChainTail,
    Checked,
    CommittedPages,
    DeviceHit,
    Pinning,
    PrefixPinning,
    Publishing,
    ReservationNoticed,
    Retaining,
    Tier,
    TierHit,
    Undoable,
)


@dataclass(slots=True)
class PendingLoad:
    """A tier hit of a request, to be copied into a fresh device page before the graph
    reads it, then committed on the device under its hash."""

    tier: int
    """Index of its tier in the stack."""
    hit: TierHit
    parent_hash: int | None
    """The hash of the page before it (None for a sequence's first page)."""
    keys: EventKeys | None
    """What events say of the page besides its tokens (`DeviceHit.keys`)."""
    device_page: int | None = None
    """The device page it loads into; taken when the reservation is applied."""
    group: int = 0
    """The cache group whose page it loads (its index in the replica; each group has
    a stack of its own tiers, `managers/paged/group_tiers.py`)."""

    @property
    def page(self) -> int:
        """`device_page`, of a load a request keeps (its page was taken when it was)."""
        assert self.device_page is not None, "a request keeps a load once its page is taken"
        return self.device_page


class TierStack:
    """The tiers of one replica (of one of its cache groups), built from `params.tiers`
    over its pool and buffers; `group_key` names the group in what the tiers share
    (`RemoteLayout.group`), None for a cache of one group."""

    def __init__(
        self,
        configs: Sequence[TierConfig],
        params: KVCacheParams,
        num_layers: int,
        pool: PagePool,
        blocks: list[Buffer],
        undo: UndoLog | None = None,
        scales: list[Buffer] | None = None,
        group_key: str | None = None,
    ) -> None:
        self.tiers: list[Tier] = []
        try:
            for config in configs:
                self.tiers.append(
                    BUILDERS.build(config, params, num_layers, pool, blocks, scales, group_key)
                )
        except BaseException:
            self.close()  # a tier built before may run threads
            raise
        self.undo = undo
        # The optional capabilities (tiers/base.py), asked once: the calls below go only
        # to the tiers that have them.
        self._pinning = [tier if isinstance(tier, Pinning) else None for tier in self.tiers]
        self._retaining = [tier for tier in self.tiers if isinstance(tier, Retaining)]
        self._prefix_pinning = [tier for tier in self.tiers if isinstance(tier, PrefixPinning)]
        self._noticed = [tier for tier in self.tiers if isinstance(tier, ReservationNoticed)]
        self._publishing = [tier for tier in self.tiers if isinstance(tier, Publishing)]
        self._checked = [tier if isinstance(tier, Checked) else None for tier in self.tiers]
        for tier in self.tiers:
            if isinstance(tier, Undoable):
                tier.undo = undo
        self._cache_tokens = [0] * len(self.tiers)  # prompt tokens each tier supplied

    def __iter__(self) -> Iterator[Tier]:
        return iter(self.tiers)

    def __len__(self) -> int:
        return len(self.tiers)

    def named(self, name: str) -> Tier | None:
        """The tier called `name` ("host", "remote"), if the replica has it."""
        return next((tier for tier in self.tiers if tier.name == name), None)

    def local_hits(self, tail: ChainTail) -> int:
        """Leading pages of `tail` that this replica's own tiers hold (a shared tier
        serves every replica alike and is not asked): a routing hint, counted nowhere."""
        found = 0
        for tier in self.tiers:
            if tier.shared:
                break
            found += len(tier.lookup(tail.pages(found)))
        return found

    def _by_index(self, loads: Sequence[PendingLoad]) -> list[tuple[int, list[PendingLoad]]]:
        """`loads` grouped by tier index, in tier order (each group in the order given)."""
        if not loads:  # a request without tier hits: its release, every reservation
            return []
        groups: list[list[PendingLoad]] = [[] for _ in self.tiers]
        for load in loads:
            groups[load.tier].append(load)
        return [(index, group) for index, group in enumerate(groups) if group]

    # --- a reservation's hits -------------------------------------------------------

    def pin(self, loads: Sequence[PendingLoad]) -> None:
        """The loads' hits stay loadable, in the tiers that pin (`Pinning`)."""
        for index, group in self._by_index(loads):
            pinning = self._pinning[index]
            if pinning is not None:
                pinning.pin([load.hit for load in group])

    def unpin(self, loads: Sequence[PendingLoad]) -> None:
        for index, group in self._by_index(loads):
            pinning = self._pinning[index]
            if pinning is not None:
                pinning.unpin([load.hit for load in group])

    def count_served(self, loads: Sequence[PendingLoad], page_size: int) -> None:
        """The loads' tokens count as supplied by their tiers (`metrics`)."""
        if self.undo is not None and loads:
            self.undo.push(setattr, self, "_cache_tokens", list(self._cache_tokens))
        for load in loads:
            self._cache_tokens[load.tier] += page_size

    def count_tokens(self, index: int, tokens: int) -> None:
        """`tokens` count as supplied by tier `index` (a joint hit of cache groups, whose
        tokens past the groups' device hit count as the slowest tier's they load from)."""
        if self.undo is not None:
            self.undo.push(setattr, self, "_cache_tokens", list(self._cache_tokens))
        self._cache_tokens[index] += tokens

    def note_reserved(
        self, fresh_pages: Sequence[int], device_hits: Sequence[Sequence[DeviceHit]]
    ) -> None:
        for tier in self._noticed:
            tier.note_reserved(fresh_pages, device_hits)

    def load(self, loads: Sequence[PendingLoad]) -> list[PendingLoad]:
        """Copies `loads` into their device pages, one batch per tier; returns them in
        the order they were copied (tier by tier). They stay pinned."""
        groups = self._by_index(loads)
        for index, group in groups:
            self.tiers[index].load([load.hit for load in group], [load.page for load in group])
        return [load for _, group in groups for load in group]

    # --- sessions ---------------------------------------------------------------------

    @property
    def local_pages(self) -> int:
        """Pages of this replica's own tiers (a shared tier has no fixed share of them)."""
        return sum(tier.metrics().total_pages for tier in self.tiers if not tier.shared)

    @property
    def kept_pages(self) -> int:
        """Pages the tiers hold for open sessions."""
        return sum(tier.metrics().kept_pages for tier in self.tiers)

    @property
    def evicted_retained_pages(self) -> int:
        """Pages the tiers evicted while an open session retained them."""
        return sum(tier.metrics().evicted_retained_pages for tier in self.tiers)

    def retain(self, page_hashes: Sequence[int]) -> None:
        """Open sessions retain these hashes, in the tiers that retain (`Retaining`)."""
        for tier in self._retaining:
            tier.retain(page_hashes)

    def unretain(self, page_hashes: Sequence[int], old_end: bool = True) -> None:
        for tier in self._retaining:
            tier.unretain(page_hashes, old_end)

    # --- pins -------------------------------------------------------------------------

    def pin_prefixes(self, page_hashes: Sequence[int]) -> None:
        """Live pins hold these hashes, in the tiers that keep pins (`PrefixPinning`)."""
        if page_hashes:
            for tier in self._prefix_pinning:
                tier.pin_prefixes(page_hashes)

    def unpin_prefixes(self, page_hashes: Sequence[int]) -> None:
        if page_hashes:
            for tier in self._prefix_pinning:
                tier.unpin_prefixes(page_hashes)

    def holds_pinned(self, page_hash: int) -> bool:
        """Whether a tier that keeps pins holds this pinned hash: then its device page
        may spill (`PagePool.spill`)."""
        return any(tier.holds_pinned(page_hash) for tier in self._prefix_pinning)

    def holds_pinnable(self, page_hash: int) -> bool:
        """Whether a tier that keeps pins holds this hash's page (a pin may hold it)."""
        return any(tier.holds(page_hash) for tier in self._prefix_pinning)

    @property
    def keeps_pins(self) -> bool:
        """Whether some tier keeps pinned prefixes."""
        return bool(self._prefix_pinning)

    # --- the rest, tier by tier -----------------------------------------------------

    def store(self, pages: CommittedPages) -> None:
        for tier in self.tiers:
            tier.store(pages)

    def reset(self) -> None:
        for tier in self.tiers:
            tier.reset()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def publish_to(self, events: TierEvents) -> None:
        for tier in self._publishing:
            tier.publish_to(events)

    def metrics(self) -> list[tuple[str, TierMetrics]]:
        """(name, counters) of each tier, with the prompt tokens it supplied."""
        return [
            (tier.name, replace(tier.metrics(), cache_tokens=tokens))
            for tier, tokens in zip(self.tiers, self._cache_tokens)
        ]

    def reset_metrics(self) -> None:
        self._cache_tokens = [0] * len(self.tiers)
        for tier in self.tiers:
            tier.reset_metrics()

    def check_invariants(self, pending: Sequence[PendingLoad]) -> None:
        """Each tier's own check, given the replica's pending loads from that tier."""
        groups: list[list[TierHit]] = [[] for _ in self.tiers]
        for load in pending:
            groups[load.tier].append(load.hit)
        for checked, hits in zip(self._checked, groups):
            if checked is not None:
                checked.check_invariants(hits)
