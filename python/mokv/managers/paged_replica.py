"""One data-parallel replica of the paged cache: a page pool, its device buffers, its requests.

A request's pages, drawn as token regions (page_size 4 here):

    pages:   [ p7      ][ p2      ][ p9      ][ p4      ]
    tokens:  |committed (hashed)  |  written | reserved for this fetch   |
             0               n_hashed*ps  start_idx              needed tokens

- the first `len(hashes)` pages are full and were committed to the prefix index
  (or found in it); their hash chain is `hashes`. They may be shared with other
  requests, so the request never writes them again: its context's `start_idx` must
  lie in `[len(hashes) * page_size, len(pages) * page_size]` (else `StaleContextError`,
  e.g. after `ctx.reset()` without a release);
- pages after them hold tokens written but not yet filling a page, and room for
  the tokens of the coming `num_steps` steps.

Prefix matching runs only when every page the request holds is committed and the
cache ends exactly at their end (a new request, or one whose cache ends on a page
boundary after a chunk or a reset); it then extends the request with the longest run of
indexed pages that continues its hash chain.

Reserving is planned, then applied: `plan` works out one request's hits and fresh
pages without changing anything, `fits` checks a batch of plans against the pool, and
`apply` takes their pages in one all-or-nothing pool call before it moves the contexts'
windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from max.driver import Buffer, Device

from ..cache.hashing import PageHashFn, iter_page_hashes, salted_root
from ..cache.page_pool import PagePool
from ..context import RequestID, TextGenerationContext
from ..errors import (
    AlreadyClaimedError,
    BatchTooLargeError,
    InvariantError,
    SequenceTooLongError,
    StaleContextError,
    UnknownRequestError,
)
from ..layouts import RaggedKVCacheInputs
from ..params import KVCacheParams


@dataclass(slots=True)
class _Request:
    slot: int
    pages: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Reservation:
    """What reserving one request will do, worked out before anything changes."""

    ctx: TextGenerationContext
    req: _Request
    hits: list[tuple[int, int]]  # (page id, hash) of cached pages that continue its chain
    hit_tokens: int  # where its cache ends after the hits
    num_new: int  # fresh pages to allocate after the hits


@dataclass(slots=True)
class CommitPlan:
    """The pages one `step` commits in a replica, worked out before anything changes."""

    requests: list[tuple[_Request, list[int]]]  # each request and its new chain hashes
    page_ids: list[int]
    hashes: list[int]
    datas: list[bytes]
    parents: list[int | None]
    salts: list[str | None]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PagedReplica:
    """The pages, buffers and requests of one replica (its devices split the KV heads)."""

    def __init__(
        self,
        params: KVCacheParams,
        num_pages: int,
        max_requests: int,
        max_seq_len: int,
        num_layers: int,
        devices: list[Device],
        hash_fn: PageHashFn,
        root_hash: int,
    ) -> None:
        self.params = params
        self.page_size = params.page_size
        self.max_seq_len = max_seq_len
        self.max_requests = max_requests
        self.devices = devices
        self.pool = PagePool(num_pages)
        self._hash_fn = hash_fn
        self._root_hash = root_hash
        self._salted_roots: dict[str, int] = {}  # cache_salt -> root of its hash chains
        self._prefix_caching = params.enable_prefix_caching
        self.max_pages_per_seq = _ceil_div(max_seq_len, params.page_size)
        shape = [
            num_pages,
            2,
            num_layers,
            params.page_size,
            params.n_kv_heads_per_device,
            params.head_dim,
        ]
        self.blocks = [Buffer(params.dtype, shape, device=d) for d in devices]
        # Row `slot` of the page table lists the pages of the request in that slot, so
        # that `runtime_inputs` gathers a whole batch's lookup table with one numpy take.
        self._page_table = np.zeros((max_requests, self.max_pages_per_seq), dtype=np.uint32)
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self._requests: dict[RequestID, _Request] = {}
        self.input_tokens = 0
        self.cache_tokens = 0

    # --- requests -------------------------------------------------------------------

    def claim(self, request_id: RequestID) -> None:
        if request_id in self._requests:
            raise AlreadyClaimedError(request_id)
        if not self._free_slots:
            raise BatchTooLargeError(
                f"cannot claim {request_id!r}: all {self.max_requests} request slots of the "
                "replica are taken (max_batch_size / data_parallel_degree)"
            )
        self._requests[request_id] = _Request(self._free_slots.pop())

    def release(self, request_id: RequestID) -> None:
        req = self._request(request_id)
        self.pool.release(reversed(req.pages))  # tail first: the prefix is evicted last
        del self._requests[request_id]
        self._free_slots.append(req.slot)

    def pages_of(self, request_id: RequestID) -> list[int]:
        return list(self._request(request_id).pages)

    def _request(self, request_id: RequestID) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequestError(request_id) from None

    def _check_window(self, ctx: TextGenerationContext, req: _Request) -> None:
        """StaleContextError unless the context's cache ends between the request's
        committed pages and the end of its pages (see the module docstring)."""
        ps = self.page_size
        if ctx.start_idx < len(req.hashes) * ps:
            raise StaleContextError(
                f"request {ctx.request_id!r} has start_idx={ctx.start_idx}, inside its "
                f"{len(req.hashes) * ps} committed tokens (pages other requests may share): "
                "release the request before ctx.reset()"
            )
        if ctx.start_idx > len(req.pages) * ps:
            raise StaleContextError(
                f"request {ctx.request_id!r} has start_idx={ctx.start_idx} but only "
                f"{len(req.pages) * ps} token slots were fetched for it"
            )

    # --- prefix cache ---------------------------------------------------------------

    def _match_prefix(self, ctx: TextGenerationContext, req: _Request) -> list[tuple[int, int]]:
        """(page id, hash) of indexed pages that continue the request's committed pages.

        Pure: changes nothing. Stops one token short of `end_idx`, which must be computed.
        """
        ps = self.page_size
        n_committed = len(req.hashes)
        if (
            not self._prefix_caching
            or len(req.pages) != n_committed
            or ctx.start_idx != n_committed * ps
        ):
            return []
        hits = []
        pages = iter_page_hashes(
            ctx.tokens, ps, self._last_hash(req, ctx), self._hash_fn, n_committed,
            (ctx.end_idx - 1) // ps,
        )
        for page_hash, data in pages:
            page_id = self.pool.lookup(page_hash, data)
            if page_id is None:
                break
            hits.append((page_id, page_hash))
        return hits

    def _last_hash(self, req: _Request, ctx: TextGenerationContext) -> int:
        """The parent hash of the request's next page: for the first page, the root of
        the request's `cache_salt` (see `mokv.cache.hashing.salted_root`)."""
        if req.hashes:
            return req.hashes[-1]
        salt = getattr(ctx, "cache_salt", None)
        if salt is None:
            return self._root_hash
        root = self._salted_roots.get(salt)
        if root is None:
            if len(self._salted_roots) >= 65536:  # bound the memo, not the salts
                self._salted_roots.clear()
            p = self.params
            root = self._salted_roots[salt] = salted_root(p.prefix_hash, p.prefix_hash_seed, salt)
        return root

    def num_prefix_hit_pages(self, ctx: TextGenerationContext) -> int:
        """Pages of `ctx`'s tokens this replica could serve from its prefix cache."""
        req = self._requests.get(ctx.request_id) or _Request(-1)
        return len(self._match_prefix(ctx, req))

    def plan_commit(self, batch: list[TextGenerationContext]) -> CommitPlan:
        """The pages of `batch` that became full since their last step, with their hashes
        (pure; StaleContextError for a context whose cache does not fit its pages)."""
        ps, plans = self.page_size, []
        page_ids, hashes, datas, parents, salts = [], [], [], [], []
        for ctx in batch:
            req = self._request(ctx.request_id)
            start = ctx.start_idx
            first, num_full = len(req.hashes), start // ps
            if start < first * ps or start > len(req.pages) * ps:
                self._check_window(ctx, req)
            if num_full <= first or not self._prefix_caching:
                continue
            parent = req.hashes[-1] if req.hashes else None  # for events: None on a first page
            salt = getattr(ctx, "cache_salt", None) if parent is None else None
            chain = iter_page_hashes(
                ctx.tokens, ps, self._last_hash(req, ctx), self._hash_fn, first, num_full
            )
            new_hashes = []
            for page_idx, (page_hash, data) in enumerate(chain, start=first):
                page_ids.append(req.pages[page_idx])
                hashes.append(page_hash)
                datas.append(data)
                parents.append(parent)
                salts.append(salt)
                new_hashes.append(page_hash)
                parent, salt = page_hash, None
            plans.append((req, new_hashes))
        return CommitPlan(plans, page_ids, hashes, datas, parents, salts)

    def commit(self, plan: CommitPlan) -> None:
        """Indexes the planned pages in one all-or-nothing pool call."""
        if plan.page_ids:
            self.pool.commit_pages(
                plan.page_ids, plan.hashes, plan.datas, plan.parents, plan.salts
            )
        for req, new_hashes in plan.requests:
            req.hashes.extend(new_hashes)

    # --- reservation ----------------------------------------------------------------

    def _check_length(self, ctx: TextGenerationContext, num_steps: int, active_idx: int) -> int:
        """Cache slots `ctx` needs for `num_steps` steps from a window ending at
        `active_idx` (each step after the first adds one token); SequenceTooLongError
        past `max_seq_len`."""
        needed = active_idx + num_steps - 1
        if needed > self.max_seq_len:
            raise SequenceTooLongError(
                f"request {ctx.request_id!r} needs {needed} tokens of cache for {num_steps} "
                f"step(s), past max_seq_len={self.max_seq_len}"
            )
        return needed

    def plan(self, ctx: TextGenerationContext, num_steps: int) -> Reservation | None:
        """What reserving `ctx` for `num_steps` steps takes; None when it holds them already.

        Pure. Raises for a request that is unknown, stale or too long.
        """
        req = self._request(ctx.request_id)
        ps, start, held = self.page_size, ctx.start_idx, len(req.pages) * self.page_size
        if start < len(req.hashes) * ps or start > held:  # inlined: runs on every step
            self._check_window(ctx, req)
        # The common decode step: the window is already held, and then no prefix can
        # match (see _match_prefix). `active_idx > start_idx` holds between steps.
        needed = ctx.active_idx + num_steps - 1
        if needed <= held and needed <= self.max_seq_len:
            return None
        hits = self._match_prefix(ctx, req)
        hit_tokens = (len(req.hashes) + len(hits)) * self.page_size if hits else ctx.start_idx
        # Where the window ends after a hit is the context's rule, not the manager's.
        active_idx = ctx.active_idx_after_skip(hit_tokens) if hits else ctx.active_idx
        needed_pages = _ceil_div(self._check_length(ctx, num_steps, active_idx), self.page_size)
        num_new = max(needed_pages - len(req.pages) - len(hits), 0)
        return Reservation(ctx, req, hits, hit_tokens, num_new)

    def fits(self, plans: list[Reservation]) -> bool:
        """Whether the pool can take every plan's hits and fresh pages at once."""
        hit_pages = [page_id for plan in plans for page_id, _ in plan.hits]
        return self.pool.can_take(hit_pages, sum(plan.num_new for plan in plans))

    def apply(self, plans: list[Reservation]) -> None:
        """Takes the pages of `plans` (which `fits`), then moves each hit context's window.

        If a context's own `skip_cached_prefix` raises, the plans whose contexts did not
        move give their pages back (cached pages evicted to make room stay evicted).
        """
        hit_pages = [page_id for plan in plans for page_id, _ in plan.hits]
        new_pages = self.pool.take(hit_pages, sum(plan.num_new for plan in plans))
        if new_pages is None:
            raise InvariantError("a reservation that fits could not take its pages")
        sizes = []
        for plan in plans:
            req, taken = plan.req, [page_id for page_id, _ in plan.hits]
            taken += new_pages[: plan.num_new]
            del new_pages[: plan.num_new]
            sizes.append((len(req.pages), len(req.hashes)))
            req.pages.extend(taken)
            req.hashes.extend(page_hash for _, page_hash in plan.hits)
            self._page_table[req.slot, : len(req.pages)] = req.pages
        for done, plan in enumerate(plans):
            if not plan.hits:
                continue
            skipped = plan.hit_tokens - plan.ctx.start_idx
            try:
                plan.ctx.skip_cached_prefix(plan.hit_tokens)
            except BaseException:
                self._give_back(plans[done:], sizes[done:])
                raise
            self.cache_tokens += skipped
            self.input_tokens += skipped

    def _give_back(self, plans: list[Reservation], sizes: list[tuple[int, int]]) -> None:
        for plan, (num_pages, num_hashes) in zip(plans, sizes):
            req = plan.req
            self.pool.release(reversed(req.pages[num_pages:]))
            del req.pages[num_pages:]
            del req.hashes[num_hashes:]

    # --- graph inputs ---------------------------------------------------------------

    def runtime_inputs(
        self, batch: list[TextGenerationContext], num_steps: int
    ) -> list[RaggedKVCacheInputs[Buffer, Buffer]]:
        """The batch's lookup table, cache lengths and max lengths on each device.

        Every request must already hold its pages (`reserve`). Plain Python lists are
        used until the final arrays: for a few dozen requests they beat numpy's
        per-call overhead.
        """
        requests = self._requests
        slots = [requests[ctx.request_id].slot for ctx in batch]
        starts = [ctx.start_idx for ctx in batch]
        actives = [ctx.active_idx - start for ctx, start in zip(batch, starts)]
        max_start = max(starts, default=0)
        max_active = max(actives, default=0)
        max_end = max((s + a for s, a in zip(starts, actives)), default=0) + num_steps - 1
        max_pages = max(1, _ceil_div(max_end, self.page_size))
        cache_lengths = np.array(starts, dtype=np.uint32)
        lookup_table = self._page_table[slots, :max_pages]
        # Row s: (most tokens one sequence processes in step s, longest cache before it).
        max_lengths = np.array(
            [(max_active if s == 0 else 1, max_start + s) for s in range(num_steps)],
            dtype=np.uint32,
        )
        # Buffer.from_numpy aliases host memory; on an accelerator the small tables are copied.
        host = [Buffer.from_numpy(cache_lengths), Buffer.from_numpy(lookup_table)]
        max_lengths_buf = Buffer.from_numpy(max_lengths)
        inputs = [
            RaggedKVCacheInputs(blocks, *(host if d.is_host else [b.to(d) for b in host]), max_lengths_buf)
            for blocks, d in zip(self.blocks, self.devices)
        ]
        self.input_tokens += sum(actives)
        return inputs

    def check_tables(self, batch: list[TextGenerationContext], num_steps: int) -> None:
        """InvariantError unless the tables `runtime_inputs` hands out for `batch` are safe:
        page ids in range, each lookup row covering the cache and the new tokens, and no
        page of a write window committed or shared (`enable_runtime_checks`)."""
        ps = self.page_size
        for ctx in batch:
            req = self._requests[ctx.request_id]
            end = ctx.active_idx + num_steps - 1
            if end > len(req.pages) * ps:
                raise InvariantError(
                    f"request {ctx.request_id!r} writes up to token {end} but holds "
                    f"{len(req.pages) * ps} token slots"
                )
            for page_idx in range(ctx.start_idx // ps, _ceil_div(end, ps)):
                page_id = req.pages[page_idx]
                if not 0 <= page_id < self.pool.num_pages:
                    raise InvariantError(f"request {ctx.request_id!r} holds page id {page_id}")
                if self.pool.page_hash(page_id) is not None or self.pool.ref_count(page_id) != 1:
                    raise InvariantError(
                        f"request {ctx.request_id!r} would write page {page_id}, which is "
                        f"committed or shared (ref count {self.pool.ref_count(page_id)})"
                    )

    def check_invariants(self) -> None:
        self.pool.check_invariants(req.pages for req in self._requests.values())
        for request_id, req in self._requests.items():
            if len(req.hashes) > len(req.pages):
                raise InvariantError(f"request {request_id!r} has more hashes than pages")
