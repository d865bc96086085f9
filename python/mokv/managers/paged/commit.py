"""What a paged replica's `step` does: commit the pages its requests filled.

`plan_commit` works out, without changing anything, which of a batch's pages became
full since their last step and their hash chain; `commit` indexes them in one
all-or-nothing pool call. When two requests computed the same page at once, the pool
indexes the first copy only, and the second request is moved onto it and its own copy
freed (`_share_duplicates`, as MAX's block manager does), so a duplicate never holds
a page until its request ends. Loaded tier pages go through the same sharing
(`ReplicaTiers.load_pending`, tier_loads.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...cache.extra_keys import request_keys
from ...cache.page_pool import PagePool
from ...context import RequestID, TextGenerationContext
from ...tiers.base import CommittedPages
from ...tiers.stack import TierStack
from ...undo import UndoLog
from .inputs import PageTable
from .plans import CommitPlan, RequestState
from .prefix import PrefixChains

_NOTHING = CommitPlan([], [], [], [], [], [], [])  # read only: a step that commits nothing


class ReplicaCommits:
    """The commit half of `PagedReplica` (a mixin over its pool, requests and tiers)."""

    page_size: int
    pool: PagePool
    chains: PrefixChains
    tiers: TierStack
    undo: UndoLog
    _prefix_caching: bool
    _tiered: bool
    _page_table: PageTable
    _requests: dict[RequestID, RequestState]
    _request: Callable[[RequestID], RequestState]  # UnknownRequestError for an unknown id

    def plan_commit(self, batch: Sequence[TextGenerationContext]) -> CommitPlan:
        """The pages of `batch` that became full since their last step, with their hashes
        (pure; StaleContextError for a context whose cache does not fit its pages).

        Every request is checked first; the columns are built only for those with pages
        to commit (at large pages, most steps have none)."""
        ps, requests, caching = self.page_size, self._requests, self._prefix_caching
        todo: list[tuple[TextGenerationContext, RequestState, int, int]] = []
        for ctx in batch:
            try:  # `_request`, inlined: once per request per step
                req = requests[ctx.request_id]
            except (KeyError, TypeError):
                req = self._request(ctx.request_id)  # raises
            start = ctx.start_idx
            first, num_full = len(req.hashes), start // ps
            if num_full < first or start > len(req.pages) * ps:
                req.check_window(ctx, ps)
            if num_full > first and caching:
                todo.append((ctx, req, first, num_full))
        if not todo:
            return _NOTHING
        # What events and tiers say of each page; nothing reads it without either.
        keyed = self.pool.events is not None or self._tiered
        plans, owners = [], []
        page_ids, hashes, datas, parents, keys = [], [], [], [], []
        for ctx, req, first, num_full in todo:
            parent = req.hashes[-1] if req.hashes else None  # for events: None on a first page
            request = request_keys(ctx) if keyed else None
            chain, _ = self.chains.pages(ctx, req, num_full)
            new_hashes = []
            for page_idx, (page_hash, data) in enumerate(chain, start=first):
                owners.append((req, page_idx))
                page_ids.append(req.pages[page_idx])
                hashes.append(page_hash)
                datas.append(data)
                parents.append(parent)
                keys.append(request.page(page_idx, ps) if request is not None else None)
                new_hashes.append(page_hash)
                parent = page_hash
            plans.append((req, new_hashes))
        return CommitPlan(plans, owners, page_ids, hashes, datas, parents, keys)

    def commit(self, plan: CommitPlan) -> None:
        """Indexes the planned pages in one all-or-nothing pool call, moves each request
        off the pages that duplicate an indexed one (`_share_duplicates`), then hands
        the newly indexed pages to every tier (`Tier.store`: after the device commit, so
        a tier's failure can only leave that tier with fewer pages)."""
        indexed: list[bool] = []
        if plan.page_ids:
            indexed = self.pool.commit_pages(
                plan.page_ids, plan.hashes, plan.datas, plan.parents, plan.keys
            )
            if not all(indexed):  # some request computed a page another committed first
                self._share_duplicates(plan.owners, plan.hashes, plan.datas, indexed)
        for req, new_hashes in plan.requests:
            self.undo.push(self._truncate, req, len(req.pages), len(req.hashes), len(req.loads))
            req.hashes.extend(new_hashes)
        if not self._tiered:
            return
        new = [i for i, ok in enumerate(indexed) if ok]
        self.tiers.store(
            CommittedPages(
                [plan.page_ids[i] for i in new],
                [plan.hashes[i] for i in new],
                [plan.datas[i] for i in new],
                [plan.parents[i] for i in new],
                [plan.keys[i] for i in new],
            )
        )

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
        for (req, page_idx), page_hash, data, ok in zip(owners, hashes, datas, indexed):
            shared = None if ok else self.pool.lookup(page_hash, data)
            if shared is None:
                continue
            self.pool.acquire(shared)
            own = req.pages[page_idx]
            self.pool.release([own])  # unhashed: back to the free pages
            req.pages[page_idx] = shared
            self.undo.push(self._set_page, req, page_idx, own)
            switched[req.slot] = req
        for req in switched.values():
            self._page_table.set_row(req.slot, req.pages)

    # --- undo -----------------------------------------------------------------------

    def _truncate(self, req: RequestState, num_pages: int, num_hashes: int, num_loads: int) -> None:
        """Undoes what a request's pages, hashes and loads gained (idempotent)."""
        del req.pages[num_pages:]
        del req.hashes[num_hashes:]
        del req.loads[num_loads:]
        self._page_table.set_row(req.slot, req.pages)

    def _set_page(self, req: RequestState, page_idx: int, page_id: int) -> None:
        req.pages[page_idx] = page_id
        self._page_table.set_row(req.slot, req.pages)
