"""CacheGroup: what a paged replica asks of each of its cache groups.

A model's layers fall into groups whose caches are written in lockstep: the layers that
read every token before them (kind "full"), layers that read a sliding window (kind
"sliding_window"), multi-head latent attention layers (kind "mla", one latent per
token), and, in the models the next group kinds serve, layers whose cache is a
recurrent state. Each group has its own pages
(its `pool`), its buffers (one per device: its layout), its page table, its metrics;
the replica holds the requests and their hash chain, which every group shares (a page
of tokens has one chain hash whatever group holds it: MAX and vLLM hash once per
request as well).

What a reservation does, per group (`PagedReplica.plan` / `apply`):

    the joint prefix hit     the longest prefix every group can serve: the full group
                             needs every page of it, a sliding-window group only the
                             window before its end (`longest_hit`), so the joint hit
                             is found by iterating until the groups agree, not by a
                             minimum (`joint.py`; MAX 26.7's
                             `longest_joint_prefix_hit`, vLLM's hybrid coordinator);
                             with one full group it is that group's run of device hits
                             (`PrefixChains.device_hits`)
    hit pages                the last `held_of_hit(n)` pages of a hit of `n`
    fresh pages              one per new page index, in every group
    apply                    `pool.take(hits, n)` on each group's pool, all or nothing
    commit (`step`)          `commit_pages`: full pages indexed under their chain hash
    slide (`step`)           the pages before `window_start` go back to the pool
    release                  every page the request holds (`held`)

Each request has a row of page ids per group (`row`: `RequestState.rows`, or
`RequestState.pages` in a replica of one group) and a first page it holds there
(`first`: 0 in a full group).

mokv differs from MAX 26.7 on purpose in two places:
- one coordinator per group, not per leaf: MAX 26.7 keeps one per leaf (K, V, scales)
  and ANDs their residency in the manager; mokv's leaves of a group share one page id
  (the layout of `blocks`: `[pages, 2, layers, page_size, heads, head_dim]`), so a
  group's pages are found or lost together;
- one pool per group over a budget they share (`budget.py`): MAX's "Jenga" pool of
  huge blocks cut into per-leaf little blocks, each group's pool a view of the slots it
  has, so memory moves to the group under pressure while each pool's accounting (room,
  eviction order) stays exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar, Protocol

from max.driver import Buffer

from ....cache.page_pool import PagePool
from ....layouts.paged import PagedInputs
from ..inputs import PageTable
from ..plans import CommitPlan, RequestState


class CacheGroup(Protocol):
    """One group of layers of a replica (see the module docstring). Every call that
    changes something records its undo in the replica's log (`pool.undo`)."""

    kind: ClassVar[str]
    """"full", "sliding_window" (MAX's `KVCacheGroupId.type`) or "mla"."""
    name: str
    """The group's name (`CacheGroupConfig.name`)."""
    index: int
    """Its place among the replica's groups (graph-input order)."""
    layers: range
    """The `layer_idx` of its layers (numbered within the group, as MAX's hybrid models
    number them)."""
    window_size: int | None
    """Tokens a query reads, itself included; None: every token before it."""
    pool: PagePool
    """The group's pages: reference counts, the prefix index, the LRU."""
    blocks: list[Buffer]
    """One buffer per device of the replica (its shard of the heads)."""
    page_table: PageTable
    """Each request's row of page ids, by request slot."""

    def row(self, req: RequestState) -> list[int]:
        """The request's row of page ids, by page index."""
        ...

    def first(self, req: RequestState) -> int:
        """The first page index the request holds."""
        ...

    def held(self, req: RequestState) -> list[int]:
        """The pages the request holds, in token order."""
        ...

    def window_start(self, start_idx: int) -> int:
        """The first page a step whose cache ends at `start_idx` reads."""
        ...

    def longest_hit(self, pages: list[int | None], n: int) -> int:
        """The longest hit of at most `n` pages the group can serve (`pages`: its page
        of each page continuing a request's chain, None where it has none)."""
        ...

    def held_of_hit(self, n: int) -> int:
        """How many of a hit's `n` pages the group takes (the last ones)."""
        ...

    def commit_pages(self, pages: CommitPlan) -> list[bool]:
        """Indexes full pages (`pages`' columns) under their chain hashes, all or
        nothing; a page whose hash another page holds already moves its owner onto that
        one. True where a page was indexed."""
        ...

    def slide(self, req: RequestState, start_idx: int, keep_ends: Sequence[int] = ()) -> None:
        """Releases the request's pages no step from `start_idx` on reads (those in
        the window before one of `keep_ends` evicted last)."""
        ...

    def release(self, req: RequestState) -> None:
        """Hands back every page the request holds."""
        ...

    def runtime_inputs(
        self, slots: Sequence[int], starts: Sequence[int], actives: Sequence[int], num_steps: int
    ) -> list[PagedInputs[Buffer, Buffer]]:
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
