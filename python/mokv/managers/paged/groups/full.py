"""FullAttentionGroup: the layers that read every token before them, on one page pool.

Its pages hold K and V of every layer of the group (`blocks`, one buffer per device:
`[num_pages, 2, num_layers, page_size, n_kv_heads_per_device, head_dim]`), and for
scaled FP8 pages their scales (`scales`, one buffer per device beside each of
`blocks`, under the same page ids), so a page is found, shared, evicted and loaded for
all of them at once. A prefix hit is a run from
the root: the group holds every page of it, and keeps every page a
request wrote until the request is released. The sliding-window group
(`sliding.py`) is this group with a window: the same pool, buffers and commits, less
of each request's row held.

Duplicates. When two requests computed the same page at once, the pool indexes the
first copy only (`PagePool.commit_pages`); the other request is moved onto it and its
own copy freed, as MAX's block manager does, so a duplicate never holds a page until
its request ends. Loaded tier pages go through the same sharing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from max.driver import Buffer, Device

from ....cache.cache_memory import cache_buffer
from ....cache.page_pool import PagePool
from ....config.params import KVCacheParams
from ....errors import InvariantError
from ....layouts.paged import PagedInputs, page_buffer_shape
from ....undo import UndoLog
from ..inputs import PageTable, ceil_div
from ..plans import CommitPlan, RequestState


class FullAttentionGroup:
    """Full-attention layers `layers` of one replica: their pool, buffers and page table.

    `name` is the group's (`CacheGroupConfig.name`) and `index` its place among the
    replica's groups: its row of a request is `req.rows[index]` in a replica of several
    groups, `req.pages` in one of a single group (`row`). `slabs` (one per device): the
    memory its buffers view, shared with the other groups (`budget.py`), and
    `scale_slabs` the memory its scales view (scaled pages); none: buffers of its
    own."""

    kind: ClassVar[str] = "full"
    window_size: int | None = None
    """Tokens a query reads, itself included; None: every token before it."""
    pages_in_window: int = 0
    """Pages a query reads before its own page, at most; 0: no bound."""

    def __init__(
        self,
        params: KVCacheParams,
        layers: range,
        num_pages: int,
        devices: Sequence[Device],
        max_requests: int,
        max_pages_per_seq: int,
        undo: UndoLog,
        name: str = "full_attention",
        index: int = 0,
        slabs: Sequence[Buffer] = (),
        scale_slabs: Sequence[Buffer] = (),
    ) -> None:
        self.name = name
        self.index = index
        self.layers = layers
        self.devices = devices
        self.page_size = params.page_size
        self.pool = PagePool(num_pages)
        self.pool.undo = undo
        self.undo = undo
        shape = page_buffer_shape(params, len(layers), num_pages)
        if slabs:  # views of a budget shared with other groups (`budget.py`)
            self.blocks = [slab.view(params.dtype, shape) for slab in slabs]
        else:
            self.blocks = [cache_buffer(params.dtype, shape, d) for d in devices]
        scales_shape = params.scales_shape(shape)
        self.scales: list[Buffer] | None = None
        if params.quantization is not None and scales_shape is not None:
            scale_dtype = params.quantization.scale_dtype
            self.scales = (
                [slab.view(scale_dtype, scales_shape) for slab in scale_slabs]
                if scale_slabs
                else [cache_buffer(scale_dtype, scales_shape, d) for d in devices]
            )
        self.page_table = PageTable(max_requests, max_pages_per_seq)

    def row(self, req: RequestState) -> list[int]:
        """The request's row of this group's pages, by page index (entries below
        `first(req)` are not held)."""
        return req.rows[self.index] if req.rows else req.pages

    def first(self, req: RequestState) -> int:
        """The first page index the request holds in this group: 0 but in a sliding
        window."""
        return req.firsts[self.index] if req.firsts else 0

    def held(self, req: RequestState) -> list[int]:
        """The pages the request holds in this group, in token order."""
        row = self.row(req)
        return row[self.first(req) :] if req.firsts else row

    # --- the joint prefix hit (`joint.py`) ------------------------------------------

    def window_start(self, start_idx: int) -> int:
        """The first page a step whose cache ends at `start_idx` reads: 0 (every page)."""
        return 0

    def slide(self, req: RequestState, start_idx: int, keep_ends: Sequence[int] = ()) -> None:
        """Releases the pages no step from `start_idx` on reads: none here."""

    def release(self, req: RequestState) -> None:
        """Hands back every page the request holds, tail first (a shared prefix is
        evicted last)."""
        self.pool.release(reversed(self.held(req)))

    def longest_hit(self, pages: list[int | None], n: int) -> int:
        """The longest prefix of `pages` (this pool's page of each page after a request's
        committed ones, None where it has none) of at most `n` pages that the group can
        serve (`run_hit`)."""
        return run_hit(pages, n)

    def held_of_hit(self, n: int) -> int:
        """How many of a hit's `n` pages the group takes (the last ones): all of them."""
        return n

    # --- commits --------------------------------------------------------------------

    def commit_pages(self, pages: CommitPlan) -> list[bool]:
        """Indexes `pages` (their columns: each page owned by `pages.owners[i]`, a request
        and the page's index in its pages) in one all-or-nothing pool call, then moves
        each request off the pages that duplicate an indexed one. True where a page was
        indexed. `pages.page_ids` are the first group's; another group reads its own
        from its rows."""
        page_ids = pages.page_ids
        if self.index:
            page_ids = [self.row(req)[page_idx] for req, page_idx in pages.owners]
        indexed = self.pool.commit_pages(
            page_ids, pages.hashes, pages.datas, pages.parents, pages.keys
        )
        if not all(indexed):  # some request computed a page another committed first
            self._share_duplicates(pages.owners, pages.hashes, pages.datas, indexed)
        return indexed

    def _share_duplicates(
        self,
        owners: list[tuple[RequestState, int]],
        hashes: list[int],
        datas: list[bytes],
        indexed: list[bool],
    ) -> None:
        """For each page that `commit_pages` did not index because another page already
        holds its hash and tokens (two requests computed the same prefix at once), the
        request takes a reference to that page and frees its own copy, as MAX does: a
        committed page is never written again, so the two are interchangeable. A page
        whose hash is held by different tokens (a collision) stays the request's own."""
        switched: dict[int, RequestState] = {}
        pool = self.pool
        for (req, page_idx), page_hash, data, ok in zip(owners, hashes, datas, indexed):
            shared = None if ok else pool.lookup(page_hash, data)
            if shared is None:
                continue
            pool.acquire(shared)
            row = self.row(req)
            own = row[page_idx]
            pool.release([own])  # unhashed: back to the free pages
            row[page_idx] = shared
            self.undo.push(self.set_page, req, page_idx, own)
            switched[req.slot] = req
        for req in switched.values():
            self.write_row(req)

    def set_page(self, req: RequestState, page_idx: int, page_id: int) -> None:
        """Page `page_idx` of the request is `page_id` (the undo of a share)."""
        self.row(req)[page_idx] = page_id
        self.write_row(req)

    def write_row(self, req: RequestState) -> None:
        """Writes the request's whole row into the page table (the pad page below the
        pages it holds)."""
        self.page_table.set_row(req.slot, self.row(req))
        first = self.first(req)
        if first:
            self.page_table.pad(req.slot, 0, first)

    def runtime_inputs(
        self, slots: Sequence[int], starts: Sequence[int], actives: Sequence[int], num_steps: int
    ) -> list[PagedInputs[Buffer, Buffer]]:
        """The batch's lookup table, cache lengths and max lengths on each device
        (`PageTable.inputs`), with the scales of scaled pages."""
        return self.page_table.inputs(
            self.blocks,
            self.devices,
            slots,
            starts,
            actives,
            num_steps,
            self.page_size,
            self.scales,
        )

    def check_write_windows(
        self, windows: Iterable[tuple[object, Sequence[int], int, int]]
    ) -> None:
        """InvariantError unless each `(request_id, pages, start_idx, end)` is safe to hand
        to the graph: its pages cover `end` tokens, and every page of the write window
        `[start_idx, end)` is in range, unhashed and owned by that request alone
        (`enable_runtime_checks`)."""
        pool, page_size = self.pool, self.page_size
        for request_id, pages, start, end in windows:
            if end > len(pages) * page_size:
                raise InvariantError(
                    f"request {request_id!r} writes up to token {end} but holds "
                    f"{len(pages) * page_size} token slots"
                )
            for page_idx in range(start // page_size, ceil_div(end, page_size)):
                page_id = pages[page_idx]
                if not 0 <= page_id < pool.num_pages:
                    raise InvariantError(f"request {request_id!r} holds page id {page_id}")
                if pool.page_hash(page_id) is not None or pool.ref_count(page_id) != 1:
                    raise InvariantError(
                        f"request {request_id!r} would write page {page_id}, which is "
                        f"committed or shared (ref count {pool.ref_count(page_id)})"
                    )

    def check_invariants(self, owned_pages: Iterable[Iterable[int]]) -> None:
        self.pool.check_invariants(owned_pages)


def run_hit(pages: Sequence[int | None], n: int) -> int:
    """A full group's longest hit of at most `n` of `pages` (found, or None): the run of
    found pages from the first (the request's own pages before them are its own)."""
    for i in range(min(n, len(pages))):
        if pages[i] is None:
            return i
    return min(n, len(pages))
