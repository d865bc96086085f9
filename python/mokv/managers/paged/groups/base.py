"""CacheGroup: what a paged replica asks of each of its cache groups.

A model's layers fall into groups whose caches are written in lockstep: the layers that
read every token before them (kind "full"), and, in the models the next group kinds
serve, layers that read a sliding window, multi-head latent (MLA) layers, and layers
whose cache is a recurrent state. Each group has its own pages (its `pool`), its
buffers (one per device: its layout), its page table, its metrics; the replica holds
the requests and their hash chain, which every group shares (a page of tokens has one
chain hash whatever group holds it: MAX and vLLM hash once per request as well).

What a reservation does, per group (`PagedReplica.plan` / `apply`):

    the joint prefix hit     the longest prefix every group can serve: the full group
                             needs every page of it, a sliding-window group only the
                             window before its end, so the joint hit is found by
                             iterating until the groups agree, not by a minimum (MAX
                             26.7's `longest_joint_prefix_hit`, vLLM's hybrid
                             coordinator); with one group it is that group's run of
                             device hits (`PrefixChains.device_hits`)
    fresh pages              the pages a request's window needs, less those it holds
    apply                    `pool.take(hits, n)` on each group's pool, all or nothing
    commit (`step`)          `commit_pages`: full pages indexed under their chain hash
    release                  `release(pages)`, tail first

Today a replica has one group, of kind "full", and the replica asks it directly; the
kind after it (sliding window, issue 52) adds a module here, the members the joint hit
needs (how many pages of a hit the group holds, which pages leave its window) and the
per-group page rows of a request (`RequestState.pages` is the full group's).

mokv differs from MAX 26.7 on purpose in two places:
- one coordinator per group, not per leaf: MAX 26.7 keeps one per leaf (K, V, scales)
  and ANDs their residency in the manager; mokv's leaves of a group share one page id
  (the layout of `blocks`: `[pages, 2, layers, page_size, heads, head_dim]`), so a
  group's pages are found or lost together;
- one pool per group, not MAX's "Jenga" pool of huge blocks cut into per-leaf little
  blocks: the share of memory each group gets is fixed when the manager is built
  (`sizing.py`), which keeps each pool's accounting (room, eviction order) exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar, Protocol

from max.driver import Buffer

from ....cache.page_pool import PagePool
from ....layouts import RaggedKVCacheInputs
from ..inputs import PageTable
from ..plans import CommitPlan


class CacheGroup(Protocol):
    """One group of layers of a replica (see the module docstring). Every call that
    changes something records its undo in the replica's log (`pool.undo`)."""

    kind: ClassVar[str]
    """"full" (today), and the kinds of the issues after it."""
    layers: range
    """The model's layers whose caches the group holds."""
    pool: PagePool
    """The group's pages: reference counts, the prefix index, the LRU."""
    blocks: list[Buffer]
    """One buffer per device of the replica (its shard of the heads)."""
    page_table: PageTable
    """Each request's row of page ids, by request slot."""

    def commit_pages(self, pages: CommitPlan) -> list[bool]:
        """Indexes full pages (`pages`' columns) under their chain hashes, all or
        nothing; a page whose hash another page holds already moves its owner onto that
        one. True where a page was indexed."""
        ...

    def runtime_inputs(
        self, slots: Sequence[int], starts: Sequence[int], actives: Sequence[int], num_steps: int
    ) -> list[RaggedKVCacheInputs[Buffer, Buffer]]:
        """The group's graph inputs for a batch, one per device of the replica."""
        ...

    def check_write_windows(
        self, windows: Iterable[tuple[object, Sequence[int], int, int]]
    ) -> None:
        """InvariantError unless each `(request id, pages, start, end)` writes only pages
        the request owns alone and unhashed."""
        ...

    def check_invariants(self, owned_pages: Iterable[Iterable[int]]) -> None:
        """InvariantError unless the pool's invariants hold for these owners."""
        ...
