"""The host-memory tier: copies of committed device pages, loaded back instead of
recomputed once the device has evicted them (README "Host tier").

    KVCacheParams(..., enable_prefix_caching=True,
                  tiers=(HostTierConfig(swap_space_gb=64),))   # all replicas together

Each replica gets `floor(swap_space_gb * 2**30 / data_parallel_degree / bytes_per_page)`
host pages, one host buffer per device shard in the device page layout (`HostPages`),
indexed by `HostPagePool` (host_pool.py: the index and the LRU over leaves).

- Write-through at commit: `store` copies the pages `step` newly indexed on the device,
  one batched copy per step and device shard. With `min_hits` a page is written only at
  the `store` after its `min_hits`-th device hit (counted by `note_reserved`), and only
  if it still carries the hash it was hit under.
- Pins: `pin` counts, per host page, the pending loads that will read it. `store` never
  picks a pinned page as a target or a victim, and nothing else evicts host pages, so a
  hit stays loadable from its match on (TensorRT-LLM #12878 was onboarding that evicted
  other reusable host blocks mid-allocation).
- Device hits refresh their host copies in the LRU (`note_reserved`).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Collection, Iterator, Sequence

from max.driver import Buffer

from ..cache.extra_keys import EventKeys
from ..cache.page_copy import HostPages
from ..cache.page_pool import PagePool
from ..config.params import KVCacheParams
from ..config.tiers import HostTierConfig
from ..errors import InsufficientMemoryError, InvariantError
from ..events.format import MEDIUM_CPU
from ..events.publisher import TierEvents
from ..metrics import TierMetrics
from ..registry import BUILDERS
from ..undo import UndoLog
from .base import CommittedPages, DeviceHit, TierHit
from .host_pool import HostPagePool


def host_memory_bytes() -> int | None:
    """The machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def build_host_tier(
    config: HostTierConfig,
    params: KVCacheParams,
    num_layers: int,
    pool: PagePool,
    blocks: list[Buffer],
    scales: list[Buffer] | None = None,
    group_key: str | None = None,
) -> HostTier:
    """The host tier of one replica (of its cache group `group_key`, which the errors
    name; registered for `HostTierConfig`), over its values `blocks` and, for scaled
    pages, their `scales`; InsufficientMemoryError when the machine cannot hold it."""
    num_pages = config.num_pages(params, num_layers)
    memory = host_memory_bytes()
    if memory is not None and config.swap_space_gb * 2**30 > memory:
        raise InsufficientMemoryError(
            f"HostTierConfig.swap_space_gb={config.swap_space_gb!r} is more than this "
            f"machine's {memory / 2**30:.1f} GiB of memory"
        )
    try:
        return HostTier(config, num_pages, pool, blocks, scales)
    except MemoryError:  # a bare MemoryError would not say which setting asked
        raise InsufficientMemoryError(
            f"HostTierConfig.swap_space_gb={config.swap_space_gb!r}: {num_pages} host "
            f"pages of {params.bytes_per_page(num_layers)} bytes per replica"
            f"{'' if group_key is None else f' for group {group_key}'} could not "
            "be allocated"
        ) from None


class HostTier:
    """One replica's host tier: `pool` (the index) over `pages` (the bytes)."""

    name = HostTierConfig.name
    shared = False

    def __init__(
        self,
        config: HostTierConfig,
        num_pages: int,
        device_pool: PagePool,
        blocks: list[Buffer],
        scales: list[Buffer] | None = None,
    ) -> None:
        self.pool = HostPagePool(num_pages)
        self.pages = HostPages(
            blocks[0].dtype,
            num_pages,
            list(blocks[0].shape[1:]),
            [b.device for b in blocks],
            None if scales is None else (scales[0].dtype, list(scales[0].shape[1:])),
        )
        self._device_pool = device_pool
        # Every device buffer a page lives in, in `pages.buffers` order: each device's
        # values, then each device's scales (scaled pages), copied together.
        self._blocks = [*blocks, *(scales or ())]
        self._pinned: Counter[int] = Counter()  # host page -> pending loads (no zeros)
        # min_hits > 0: device hits per device page since it was handed out, and the
        # hits that reached the threshold, written through at the next `store`.
        self._min_hits = config.min_hits
        self._page_hits = [0] * device_pool.num_pages if self._min_hits else []
        self._promoted: list[DeviceHit] = []
        self._prefix_pins: set[int] = set()  # hashes live pins hold: never evicted here

    @property
    def undo(self) -> UndoLog | None:
        """Where the tier and its host pool record how to undo their changes."""
        return self.pool.undo

    @undo.setter
    def undo(self, log: UndoLog | None) -> None:
        self.pool.undo = log

    @property
    def pinned(self) -> dict[int, int]:
        """Host page -> the pending loads that will read it."""
        return dict(self._pinned)

    # --- reads ----------------------------------------------------------------------

    def lookup(self, chain: Iterator[tuple[int, bytes]]) -> list[TierHit]:
        hits = []
        for page_hash, data in chain:
            host_page = self.pool.lookup(page_hash, data)
            if host_page is None:
                break
            hits.append(TierHit(page_hash, data, host_page))
        return hits

    def pin(self, hits: Sequence[TierHit]) -> None:
        handles = [hit.handle for hit in hits]
        self._pin(handles)
        if self.undo is not None:
            self.undo.push(self._unpin, handles)

    def unpin(self, hits: Sequence[TierHit]) -> None:
        handles = [hit.handle for hit in hits]
        self._unpin(handles)
        if self.undo is not None:
            self.undo.push(self._pin, handles)

    def _pin(self, handles: list[int]) -> None:
        self._pinned.update(handles)

    def _unpin(self, handles: list[int]) -> None:
        self._pinned.subtract(handles)
        self._pinned += Counter()  # drops the zeros

    def load(self, hits: Sequence[TierHit], device_pages: Sequence[int]) -> None:
        self.pages.load([hit.handle for hit in hits], self._blocks, device_pages)
        self.pool.mark_loaded(hit.handle for hit in hits)

    def note_reserved(
        self, fresh_pages: Sequence[int], device_hits: Sequence[Sequence[DeviceHit]]
    ) -> None:
        if self._min_hits:
            counts = self._page_hits
            touched = [*fresh_pages, *(hit.page_id for run in device_hits for hit in run)]
            if self.undo is not None:  # restoring old values: pushed first, idempotent
                self.undo.push(
                    self._restore_hits, [(p, counts[p]) for p in touched], len(self._promoted)
                )
            for page_id in fresh_pages:
                counts[page_id] = 0
            for run in device_hits:
                for hit in run:
                    counts[hit.page_id] += 1
                    if counts[hit.page_id] == self._min_hits:
                        self._promoted.append(hit)
        # A request's prefix is refreshed last: it outlives the suffixes after it.
        self.pool.touch_hashes(hit.page_hash for run in device_hits for hit in reversed(run))

    # --- writes ---------------------------------------------------------------------

    def store(self, pages: CommittedPages) -> None:
        if self._min_hits:
            self._store_promoted()
        elif pages.page_ids:
            self._write_through(
                pages.page_ids, pages.hashes, pages.token_bytes, pages.parents, pages.keys
            )

    def _store_promoted(self) -> None:
        """Writes through the pages that reached `min_hits` device hits and still carry
        the hash they were hit under (a released page may have been evicted and reused
        since)."""
        promoted, self._promoted = self._promoted, []
        if self.undo is not None:
            self.undo.push(setattr, self, "_promoted", promoted)
        pool, rows = self._device_pool, []
        for hit in promoted:
            if pool.page_hash(hit.page_id) == hit.page_hash:
                rows.append(
                    (
                        hit.page_id,
                        hit.page_hash,
                        pool.page_tokens(hit.page_id),
                        hit.parent_hash,
                        hit.keys,
                    )
                )
        if rows:
            self._write_through(*(list(column) for column in zip(*rows)))

    def _write_through(
        self,
        page_ids: list[int],
        hashes: list[int],
        datas: list[bytes],
        parents: list[int | None],
        keys: list[EventKeys | None],
    ) -> None:
        """Copies device pages (parents first) to host pages: one batched copy. Pages that
        find no room (every host page pinned) are not stored.

        A failure can only leave the tier with fewer pages (victims evicted, targets
        still free), never a hash over other bytes: the targets are indexed only after
        their bytes were copied.
        """
        protected: Collection[int] = self._pinned
        if self._prefix_pins:
            held = map(self.pool.page_of, self._prefix_pins)
            protected = {*self._pinned, *(p for p in held if p is not None)}
        plan = self.pool.plan_store(hashes, protected)
        self.pool.touch(plan.present)
        if not plan.entries:
            return
        self.pool.evict(plan.victims)
        if plan.victims and self.undo is not None:
            self.undo.push(self.pool.lose, plan.victims)  # the copy overwrites them
        e = plan.entries
        self.pages.offload(self._blocks, [page_ids[i] for i in e], plan.targets)
        self.pool.insert(
            plan.targets,
            [hashes[i] for i in e],
            [datas[i] for i in e],
            [parents[i] for i in e],
            [keys[i] for i in e],
        )
        if self._prefix_pins:  # their device pages may spill now (`PagePool.spill`)
            self._device_pool.note_spillable(
                h for h in (hashes[i] for i in e) if h in self._prefix_pins
            )

    def _restore_hits(self, counts: list[tuple[int, int]], num_promoted: int) -> None:
        for page_id, count in counts:  # each the value before the change
            self._page_hits[page_id] = count
        del self._promoted[num_promoted:]

    # --- the rest of the protocol ---------------------------------------------------

    def reset(self) -> None:
        """Every host page becomes free; pinned ones keep their bytes until loaded."""
        self.pool.reset_prefix_cache()

    def close(self) -> None:
        """Nothing to close: the host buffers go with the tier."""

    def publish_to(self, events: TierEvents) -> None:
        self.pool.events = events.medium_sink(MEDIUM_CPU)

    def metrics(self) -> TierMetrics:
        return TierMetrics(
            used_pages=self.pool.num_cached,
            total_pages=self.pool.num_pages,
            bytes_stored=self.pages.bytes_to_host,
            bytes_loaded=self.pages.bytes_from_host,
            evicted_unused_pages=self.pool.num_evicted_unused,
            kept_pages=self.pool.num_kept,
            evicted_retained_pages=self.pool.num_evicted_retained,
        )

    def reset_metrics(self) -> None:
        self.pages.bytes_to_host = self.pages.bytes_from_host = 0
        self.pool.num_evicted_unused = self.pool.num_evicted_retained = 0

    def pin_prefixes(self, page_hashes: Sequence[int]) -> None:
        self._prefix_pins.update(page_hashes)
        if self.undo is not None:
            self.undo.push(self._prefix_pins.difference_update, list(page_hashes))
        self._device_pool.note_spillable(h for h in page_hashes if self.holds_pinned(h))

    def unpin_prefixes(self, page_hashes: Sequence[int]) -> None:
        gone = [h for h in page_hashes if h in self._prefix_pins]
        self._prefix_pins.difference_update(gone)
        if self.undo is not None:
            self.undo.push(self._prefix_pins.update, gone)

    @property
    def pinned_prefixes(self) -> frozenset[int]:
        """The hashes live pins hold (`pin_prefixes`)."""
        return frozenset(self._prefix_pins)

    def holds_pinned(self, page_hash: int) -> bool:
        return page_hash in self._prefix_pins and self.holds(page_hash)

    def holds(self, page_hash: int) -> bool:
        return self.pool.page_of(page_hash) is not None

    def retain(self, page_hashes: Sequence[int]) -> None:
        self.pool.retain(page_hashes)

    def unretain(self, page_hashes: Sequence[int], old_end: bool) -> None:
        self.pool.unretain(page_hashes, old_end)

    def check_invariants(self, pinned: Sequence[TierHit]) -> None:
        """Also: a host page is never served for tokens other than its own (the
        TensorRT-LLM #8813 class of bug)."""
        self.pool.check_invariants()
        pins: Counter[int] = Counter()
        for hit in pinned:
            pins[hit.handle] += 1
            h = self.pool.page_hash(hit.handle)
            if h is not None and (
                h != hit.page_hash or self.pool.page_tokens(hit.handle) != hit.token_bytes
            ):
                raise InvariantError(
                    f"a pending load would read host page {hit.handle}, which now holds "
                    f"other tokens (hash {h}, expected {hit.page_hash})"
                )
        if pins != self._pinned:
            raise InvariantError(f"host pins {dict(self._pinned)} but pending loads {dict(pins)}")


BUILDERS.register(HostTierConfig, build_host_tier)
