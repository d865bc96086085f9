"""The shared tier: pages on a Redis (or Valkey) server that several managers share, over
`mokv.remote` (README "Shared tier").

    KVCacheParams(..., enable_prefix_caching=True,
                  tiers=(RemoteTierConfig(url="redis://10.0.0.5:6379/0",
                                          namespace="llama-3.2-1b"),))

Each replica opens one `RemotePageStore` per device shard (its layout names the shard);
nothing is sent before the first request.

- `store` queues every page the device newly indexed to each shard's store (a copy; the
  writer threads send it, the scheduler never waits for the server). Pages loaded from
  the store are not written back to it.
- `lookup` asks each shard's store for the chain (one `lookup` per shard, each for no
  more pages than the shards before it returned): a page counts only if every shard
  holds it. The validated bytes ride in the hits, so there is nothing to pin, and
  `load` copies them into the device pages (one pass per shard).
- Scaled FP8 pages: a page's value holds each shard's values and then its scales
  (`RemoteLayout`), so a loaded page is both, bit for bit, or a miss.
- A failing server is a miss, never an error or a wrong page (see `RemotePageStore`).
- Events: the pages every shard queued are announced with medium "EXTERNAL"; evictions
  never are (the server evicts by itself).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from max.driver import Buffer

from ..cache.page_copy import read_pages, write_pages
from ..cache.page_pool import PageEventSink, PagePool
from ..config.params import KVCacheParams
from ..config.tiers import RemoteTierConfig
from ..errors import InvariantError
from ..events.format import MEDIUM_SHARED
from ..events.publisher import TierEvents
from ..metrics import TierMetrics
from ..registry import BUILDERS
from ..remote import PageCodec, RemoteLayout, RemoteMetrics, RemotePageStore, StateLayout
from .base import CommittedPages, TierHit

REMOTE_QUEUE_BYTES = 256 * 2**20
"""Most value bytes one shard's store holds queued for its writer before it drops pages:
a page count alone would let large pages (4 MiB at Llama-3.2-1B's bf16 page of 128)
queue a GiB per shard behind a slow server."""


def open_stores(
    config: RemoteTierConfig, layouts: Sequence[RemoteLayout | StateLayout]
) -> list[RemotePageStore]:
    """One store per layout (device shard) of `config`'s server and namespace, each
    queueing at most `REMOTE_QUEUE_BYTES` of values. All or nothing: the stores opened
    before a failure are closed (each runs a writer thread)."""
    stores: list[RemotePageStore] = []
    try:
        for layout in layouts:
            value_nbytes = PageCodec(layout, config.namespace, config.mac_key).value_nbytes
            stores.append(
                RemotePageStore(
                    config.url,
                    config.namespace,
                    layout,
                    mac_key=config.mac_key,
                    timeout_s=config.timeout_s,
                    max_queued_pages=max(8, REMOTE_QUEUE_BYTES // value_nbytes),
                )
            )
    except BaseException:
        for store in stores:
            store.close()
        raise
    return stores


class RemoteTier:
    """One replica's view of the shared store: `stores[d]` holds device shard `d`. The
    core of a tier, `publish_to` and `check_invariants`: nothing to pin (its hits carry
    their bytes), refresh or retain (the server keeps its own LRU) or undo (stored pages
    are the server's, valid pages, and its announcements the event recorder's)."""

    name = RemoteTierConfig.name
    shared = True

    def __init__(
        self,
        config: RemoteTierConfig,
        layouts: list[RemoteLayout],
        blocks: list[Buffer],
        scales: list[Buffer] | None = None,
    ) -> None:
        self.stores = open_stores(config, layouts)
        self._layouts = layouts
        self._blocks = blocks
        self._scales = scales  # each shard's scales beside its values (scaled pages)
        self._views: dict[int, np.ndarray] = {}  # numpy views of the buffers, by buffer id
        self._bytes_loaded = 0
        self._events: PageEventSink | None = None

    def store_metrics(self) -> RemoteMetrics:
        """The stores' own counters, summed over the shards (each counts its pages)."""
        return sum((store.metrics for store in self.stores), RemoteMetrics())

    # --- reads ----------------------------------------------------------------------

    def lookup(self, chain: Iterator[tuple[int, bytes]]) -> list[TierHit]:
        pages = list(chain)
        shards: list[list[memoryview]] = []
        found = len(pages)
        for store in self.stores:
            shards.append(store.lookup(pages, found) if found else [])
            found = len(shards[-1])
        return [
            TierHit(page_hash, data, tuple(shard[i] for shard in shards))
            for i, (page_hash, data) in enumerate(pages[:found])
        ]

    def load(self, hits: Sequence[TierHit], device_pages: Sequence[int]) -> None:
        for shard, block in enumerate(self._blocks):
            pages = [hit.handle[shard] for hit in hits]
            if self._scales is None:
                write_pages(pages, block, device_pages, self._views)
                continue
            split = self._layouts[shard].values_nbytes  # values, then scales
            write_pages([p[:split] for p in pages], block, device_pages, self._views)
            write_pages([p[split:] for p in pages], self._scales[shard], device_pages, self._views)
        self._bytes_loaded += sum(page.nbytes for hit in hits for page in hit.handle)

    # --- writes ---------------------------------------------------------------------

    def store(self, pages: CommittedPages) -> None:
        """Queues the pages to each shard's store. `put` copies the bytes and never
        blocks or raises for the server: a full queue drops the page (counted). Pages
        every shard queued are announced to the replica's events (medium "EXTERNAL")."""
        if not pages.page_ids:
            return
        queued = [True] * len(pages.page_ids)
        for shard, (store, block) in enumerate(zip(self.stores, self._blocks)):
            values: list[Any] = read_pages(block, pages.page_ids, self._views)
            if self._scales is not None:  # one value: the page's values, then its scales
                scales = read_pages(self._scales[shard], pages.page_ids, self._views)
                values = list(zip(values, scales))
            for i, (page_hash, data, page) in enumerate(
                zip(pages.hashes, pages.token_bytes, values)
            ):
                queued[i] &= store.put(page_hash, data, page)
        if self._events is not None:
            for i, ok in enumerate(queued):
                if ok:
                    self._events.stored(
                        pages.hashes[i], pages.parents[i], pages.token_bytes[i], pages.keys[i]
                    )

    # --- the rest of the protocol ---------------------------------------------------

    def reset(self) -> None:
        """Nothing: the store is shared, not this replica's to clear."""

    def close(self) -> None:
        """Sends the queued pages (a bounded wait per store) and disconnects."""
        for store in self.stores:
            store.close()

    def publish_to(self, events: TierEvents) -> None:
        """Announces the pages this replica queued to the store, with medium "EXTERNAL".
        Never a removal: the server evicts by itself and tells no one (a router's view of
        the shared tier may hold pages already gone). Loaded pages are announced as the
        device indexes them."""
        self._events = events.medium_sink(MEDIUM_SHARED)

    def metrics(self) -> TierMetrics:
        """The bytes loaded; what the writer threads sent is `store_metrics()`."""
        return TierMetrics(bytes_loaded=self._bytes_loaded)

    def reset_metrics(self) -> None:
        """Zeroes the bytes loaded; the stores' own counters only grow."""
        self._bytes_loaded = 0

    def check_invariants(self, pinned: Sequence[TierHit]) -> None:
        for hit in pinned:
            if len(hit.handle) != len(self.stores):
                raise InvariantError(
                    f"a pending remote load of page {hit.page_hash} carries "
                    f"{len(hit.handle)} shards for {len(self.stores)} stores"
                )


def build_remote_tier(
    config: RemoteTierConfig,
    params: KVCacheParams,
    num_layers: int,
    pool: PagePool,
    blocks: list[Buffer],
    scales: list[Buffer] | None = None,
    group_key: str | None = None,
) -> RemoteTier:
    """The shared tier of one replica (registered for `RemoteTierConfig`): one store
    per device shard, each under its own layout (which names the cache group
    `group_key` of a cache of several, `RemoteLayout.group`); a scaled page's value
    holds its scales after its values."""
    layouts = [
        RemoteLayout.from_params(params, num_layers, shard, group_key)
        for shard in range(len(blocks))
    ]
    return RemoteTier(config, layouts, blocks, scales)


BUILDERS.register(RemoteTierConfig, build_remote_tier)
