"""SharedCheckpoints: the recurrent state's checkpoints in the shared tier
(`RemoteTierConfig` beside `KVCacheParams.recurrent`), over `mokv.remote`.

A checkpoint the state group takes (`RecurrentStateGroup.slide`) is written through to
the shared store as the attention groups' committed pages are: one value per device
shard, under the chain hash and tokens of its boundary page, its key space named by a
`StateLayout` (the state's regions, their layers, row shapes and dtypes, the page size,
the shard and the hash scheme), so caches of different state layouts share no keys and
a value copied under another layout's key is refused (`PageCodec`).

The joint prefix hit asks for the pages of a chain that neither the device nor the host
tier holds a checkpoint of (`probe`: one pipelined EXISTS per page and shard, one round
trip per shard) and marks them as `SharedCheckpoint`s; only a checkpoint the hit then
chooses (the last one at or before the attention groups' hit) is fetched (`load`: one
GET per shard, every value validated), and one that fails to load is no checkpoint:
the hit moves down to the one before it (`RecurrentStateGroup.longest_hit`). So a hit
never passes the checkpoint it resumes from, and a failing server (a timeout, an open
breaker, a refused value) is a miss, never an error or a wrong state.

Nothing here is undone: a stored checkpoint is the state after its boundary's tokens
(a valid value whatever a rollback does later, as a stored page is), and a load writes
host buffers no one else holds; the resume that copies them into a live block records
its own undo.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from max.driver import CPU, Buffer

from ....cache.page_copy import numpy_view
from ....config.params import KVCacheParams
from ....config.tiers import RemoteTierConfig
from ....remote import RemoteMetrics, StateLayout
from ....tiers.remote import open_stores
from .state_host import StoredCheckpoint


class SharedCheckpoint(NamedTuple):
    """A checkpoint every shard's store held when the chain was probed, not yet loaded."""

    page_hash: int
    token_bytes: bytes


class SharedCheckpoints:
    """One replica's checkpoints in the shared store: `stores[d]` holds device shard `d`'s
    state (`layouts[d]`)."""

    def __init__(self, config: RemoteTierConfig, layouts: Sequence[StateLayout]) -> None:
        self.layouts = list(layouts)
        self.stores = open_stores(config, layouts)

    def probe(self, chain: Sequence[tuple[int, bytes]]) -> list[SharedCheckpoint | None]:
        """For each `(hash, token bytes)` page of `chain`, a `SharedCheckpoint` if every
        shard's store holds a value there (not validated: `load` does), else None."""
        held = [True] * len(chain)
        hashes = [page_hash for page_hash, _ in chain]
        for store in self.stores:
            held = [a and b for a, b in zip(held, store.present(hashes))]
            if not any(held):
                break
        return [SharedCheckpoint(h, data) if ok else None for (h, data), ok in zip(chain, held)]

    def load(self, found: SharedCheckpoint) -> StoredCheckpoint | None:
        """The checkpoint's state in host buffers (region, then device; as the host tier
        keeps it), or None if a shard's value is gone, refused or on a failed server."""
        views = []
        for store in self.stores:
            view = store.get(found.page_hash, found.token_bytes)
            if view is None:
                return None
            views.append(view)
        copies: list[list[Buffer]] = [[] for _ in self.layouts[0].regions]
        for layout, view in zip(self.layouts, views):
            start = 0
            for r, region in enumerate(layout.regions):
                host = Buffer(region.dtype, [region.num_layers, *region.row_shape], CPU())
                rows = numpy_view(host)
                end = start + region.bytes_per_state
                rows[...] = np.frombuffer(view[start:end], rows.dtype).reshape(rows.shape)
                copies[r].append(host)
                start = end
        return StoredCheckpoint(found.page_hash, copies, shared=True)

    def store(self, page_hash: int, token_bytes: bytes, copies: list[list[Buffer]]) -> None:
        """Queues a checkpoint's state (`copies`, region then device) to each shard's
        store; never blocks or raises for the server (a full queue drops it, counted)."""
        for d, store in enumerate(self.stores):
            store.put(page_hash, token_bytes, tuple(numpy_view(c[d]) for c in copies))

    def metrics(self) -> RemoteMetrics:
        """The stores' own counters, summed over the shards."""
        return sum((store.metrics for store in self.stores), RemoteMetrics())

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Waits until each store sent what it queued; False on a timeout."""
        return all([store.flush(timeout_s) for store in self.stores])

    def close(self) -> None:
        """Sends what is queued (a bounded wait per store) and disconnects."""
        for store in self.stores:
            store.close()


def shared_checkpoints(params: KVCacheParams, num_devices: int) -> SharedCheckpoints | None:
    """The shared tier's checkpoints of a replica of `num_devices` devices built from
    `params` (None without a recurrent state or a `RemoteTierConfig`)."""
    config = next((t for t in params.tiers if isinstance(t, RemoteTierConfig)), None)
    state = params.recurrent
    if config is None or state is None:
        return None
    layouts = [
        StateLayout(
            state.regions,
            params.page_size,
            rank,
            params.tensor_parallel_degree,
            params.prefix_hash,
        )
        for rank in range(num_devices)
    ]
    return SharedCheckpoints(config, layouts)
