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

The host tier (`enable_kvcache_swapping_to_host`): `commit` writes the pages it indexes
through to host pages (one batched copy per step). The prefix match continues past the
last device hit into the host tier; each host hit gets a fresh device page and a pending
load `(device page, host page, hash, tokens, parent)` on the request, which pins the
host page (`_pinned`) from `apply` on. Taking device pages never evicts a host page (only
`commit`'s write-through does, and never a pinned one), so no host hit of a batch can be
lost between its match and its load (TensorRT-LLM #12878). `fetch` runs the
pending loads of its batch as one batched copy before the graph runs (`load_pending`),
then indexes the loaded device pages. Releasing a request drops its pending loads.

The shared tier (`remote_kvcache_url`, `mokv.remote`): one `RemotePageStore` per device
shard. `commit` queues every newly indexed page to the stores (a copy, sent by their
writer threads; the scheduler never waits for the server). `plan` continues the chain
past the host hits with one `lookup` per shard (a page counts only if every shard
returned it), if the request fits without them; the validated bytes ride in the reservation as loads with `shards`, get
fresh device pages in `apply`, and `load_pending` copies them in and indexes them with
the host loads. Nothing to pin: the bytes are already in the process. Pages loaded from
the store are not written back to it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np
from max.driver import Buffer, Device

from ..cache.cache_memory import cache_buffer
from ..cache.hashing import PageHashFn, iter_page_hashes, salted_root
from ..cache.host_pool import HostPagePool
from ..cache.page_copy import HostPages, read_pages, write_pages
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
from ..remote import RemoteLayout, RemotePageStore


@dataclass(slots=True)
class _Request:
    slot: int
    pages: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    loads: list[_Load] = field(default_factory=list)  # host hits not yet copied in
    remote_loads: list[_Load] = field(default_factory=list)  # remote hits not yet copied in


@dataclass(slots=True)
class _Load:
    """A hit waiting for `load_pending`: host page -> the request's device page, or
    for a remote hit (`host_page` -1) its validated bytes, one view per device shard."""

    device_page: int
    host_page: int
    page_hash: int
    token_bytes: bytes
    parent_hash: int | None
    cache_salt: str | None
    shards: tuple[memoryview, ...] = ()


@dataclass(slots=True)
class Reservation:
    """What reserving one request will do, worked out before anything changes."""

    ctx: TextGenerationContext
    req: _Request
    hits: list[tuple[int, int]]  # (page id, hash) of cached pages that continue its chain
    hit_tokens: int  # where its cache ends after the hits (device, host and remote)
    num_new: int  # fresh pages to allocate after the hits
    host_hits: list[_Load] = field(default_factory=list)  # device_page -1 until `apply`
    remote_hits: list[_Load] = field(default_factory=list)  # likewise, after the host hits

    @property
    def num_loads(self) -> int:
        """Hits that need a fresh device page (host and remote)."""
        return len(self.host_hits) + len(self.remote_hits)


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


REMOTE_QUEUE_BYTES = 256 * 2**20
"""Most value bytes one shard's store holds queued for its writer before it drops pages:
a page count alone would let large pages (4 MiB at Llama-3.2-1B's bf16 page of 128)
queue a GiB per shard behind a slow server."""


def _remote_queue_pages(layout: RemoteLayout) -> int:
    return max(8, REMOTE_QUEUE_BYTES // layout.value_nbytes)


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
        num_host_pages: int = 0,
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
        self.blocks = [cache_buffer(params.dtype, shape, d) for d in devices]
        # The host tier: None when off. `_pinned[host page]` counts the pending loads
        # that read it (a Counter without zeros).
        self.host: HostPagePool | None = None
        self.host_pages: HostPages | None = None
        if num_host_pages:
            self.host = HostPagePool(num_host_pages)
            self.host_pages = HostPages(params.dtype, num_host_pages, shape[1:], devices)
        self._pinned: Counter[int] = Counter()
        self.host_cache_tokens = 0
        # The shared tier: one store per device shard (its layout names the shard).
        self.remote: list[RemotePageStore] = []
        if params.remote_kvcache_url is not None:
            layouts = [RemoteLayout.from_params(params, num_layers, shard)
                       for shard in range(len(devices))]
            self.remote = [
                RemotePageStore(params.remote_kvcache_url, params.remote_kvcache_namespace,
                                layout, timeout_s=params.remote_kvcache_timeout_s,
                                max_queued_pages=_remote_queue_pages(layout))
                for layout in layouts
            ]
        self._block_views: dict[int, np.ndarray] = {}
        self.remote_cache_tokens = 0
        self.bytes_from_remote = 0
        # host_kvcache_min_hits > 0: device hits per page since it was handed out, and
        # the (page, hash, parent, salt) that reached the threshold, written at `commit`.
        self._min_hits = params.host_kvcache_min_hits
        self._page_hits = [0] * num_pages if self._min_hits else []
        self._promoted: list[tuple[int, int, int | None, str | None]] = []
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
        self._pinned.subtract(load.host_page for load in req.loads)
        self._pinned += Counter()  # drops the zeros
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

    def _match_prefix(
        self, ctx: TextGenerationContext, req: _Request, num_steps: int | None = None
    ) -> tuple[list[tuple[int, int]], list[_Load]]:
        """(page id, hash) of indexed device pages that continue the request's committed
        pages, then the host pages that continue those (device page -1: not taken yet).

        With `num_steps` (a reservation's), the host walk is skipped when the device hits
        alone leave a plan that cannot fit: a host hit needs a fresh device page as a
        missed page does, and more hits only move the window further, so no host hit can
        make it fit. That walk was most of the tier's cost: a request at the head of the
        queue is retried every step until pages free up, and on the trace replay 97% of
        the host pages matched belonged to such failed tries.

        Pure: changes nothing. Stops one token short of `end_idx`, which must be computed.
        """
        ps = self.page_size
        n_committed = len(req.hashes)
        hits: list[tuple[int, int]] = []
        host_hits: list[_Load] = []
        if not self._can_match(ctx, req):
            return hits, host_hits
        pages = iter_page_hashes(
            ctx.tokens, ps, self._last_hash(req, ctx), self._hash_fn, n_committed,
            (ctx.end_idx - 1) // ps,
        )
        for page_hash, data in pages:
            page_id = self.pool.lookup(page_hash, data)
            if page_id is None:
                break
            hits.append((page_id, page_hash))
        else:
            return hits, host_hits
        if self.host is None:
            return hits, host_hits
        if num_steps is not None and not self.fits([self._reservation(ctx, req, num_steps, hits)]):
            return hits, host_hits
        # The chain continues in the host tier from the page the device missed.
        parent = hits[-1][1] if hits else req.hashes[-1] if req.hashes else None
        salt = getattr(ctx, "cache_salt", None) if parent is None else None
        while (host_page := self.host.lookup(page_hash, data)) is not None:
            host_hits.append(_Load(-1, host_page, page_hash, data, parent, salt))
            parent, salt = page_hash, None
            nxt = next(pages, None)
            if nxt is None:
                break
            page_hash, data = nxt
        return hits, host_hits

    def _can_match(self, ctx: TextGenerationContext, req: _Request) -> bool:
        """Whether a prefix may extend the request now (see the module docstring)."""
        n_committed = len(req.hashes)
        return (self._prefix_caching and len(req.pages) == n_committed
                and ctx.start_idx == n_committed * self.page_size)

    def _match_remote(self, ctx: TextGenerationContext, req: _Request,
                      hits: list[tuple[int, int]], host_hits: list[_Load]) -> list[_Load]:
        """The remote pages that continue the chain past the device and host hits, as
        loads carrying their validated bytes (device page -1: not taken yet).

        One `lookup` per device shard, each asking for no more pages than the shards
        before it returned: a page counts only if every shard holds it. Changes no
        state but the stores' counters; a failing server is a miss.
        """
        ps = self.page_size
        first = len(req.hashes) + len(hits) + len(host_hits)
        end = (ctx.end_idx - 1) // ps  # the last token must be computed, as in _match_prefix
        if first >= end or not self._can_match(ctx, req):
            return []
        parent = (host_hits[-1].page_hash if host_hits else hits[-1][1] if hits
                  else req.hashes[-1] if req.hashes else None)
        chain = list(iter_page_hashes(ctx.tokens, ps, self._last_hash(req, ctx)
                                      if parent is None else parent, self._hash_fn, first, end))
        shards: list[list[memoryview]] = []
        found = len(chain)
        for store in self.remote:
            shards.append(store.lookup(chain, found) if found else [])
            found = len(shards[-1])
        salt = getattr(ctx, "cache_salt", None) if parent is None else None
        loads = []
        for i, (page_hash, data) in enumerate(chain[:found]):
            loads.append(_Load(-1, -1, page_hash, data, parent, salt,
                               tuple(pages[i] for pages in shards)))
            parent, salt = page_hash, None
        return loads

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
        hits, host_hits = self._match_prefix(ctx, req)
        return len(hits) + len(host_hits)

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
        """Indexes the planned pages in one all-or-nothing pool call, then writes the
        newly indexed ones through to the host tier (see `_write_through`)."""
        indexed: list[bool] = []
        if plan.page_ids:
            indexed = self.pool.commit_pages(
                plan.page_ids, plan.hashes, plan.datas, plan.parents, plan.salts
            )
        for req, new_hashes in plan.requests:
            req.hashes.extend(new_hashes)
        new = [i for i, ok in enumerate(indexed) if ok]
        if self.remote and new:
            self._write_remote([plan.page_ids[i] for i in new], [plan.hashes[i] for i in new],
                               [plan.datas[i] for i in new])
        if self.host is None:
            return
        if self._min_hits:
            self._write_promoted()
            return
        if new:
            self._write_through(*([seq[i] for i in new] for seq in (
                plan.page_ids, plan.hashes, plan.datas, plan.parents, plan.salts)))

    def _write_promoted(self) -> None:
        """Writes through the pages that reached `host_kvcache_min_hits` device hits and
        still carry the hash they were hit under (a released page may have been evicted
        and reused since)."""
        promoted, self._promoted = self._promoted, []
        pool, rows = self.pool, []
        for page_id, page_hash, parent, salt in promoted:
            if pool.page_hash(page_id) == page_hash:
                rows.append((page_id, page_hash, pool.page_tokens(page_id), parent, salt))
        if rows:
            self._write_through(*(list(col) for col in zip(*rows)))  # type: ignore[arg-type]

    def _write_through(self, page_ids: list[int], hashes: list[int], datas: list[bytes],
                       parents: list[int | None], salts: list[str | None]) -> None:
        """Copies newly indexed device pages (parents first) to host pages: one batched
        copy. Best effort: pages that find no room (every host page pinned) are not stored.

        After the device commit, so a failure here can only leave the host tier with
        fewer pages (victims evicted, targets still free), never a hash over other bytes:
        the targets are indexed only after their bytes were copied.
        """
        assert self.host is not None and self.host_pages is not None
        plan = self.host.plan_store(hashes, self._pinned)
        self.host.touch(plan.present)
        if not plan.entries:
            return
        self.host.evict(plan.victims)
        e = plan.entries
        self.host_pages.offload(self.blocks, [page_ids[i] for i in e], plan.targets)
        self.host.insert(plan.targets, [hashes[i] for i in e], [datas[i] for i in e],
                         [parents[i] for i in e], [salts[i] for i in e])

    def _write_remote(self, page_ids: list[int], hashes: list[int], datas: list[bytes]) -> None:
        """Queues newly indexed device pages (parents first) to the shared tier, each shard
        to its own store. `put` copies the bytes and never blocks or raises for the
        server: a full queue drops the page (counted in the store's metrics)."""
        for store, block in zip(self.remote, self.blocks):
            for page_hash, data, page in zip(hashes, datas,
                                             read_pages(block, page_ids, self._block_views)):
                store.put(page_hash, data, page)

    def close_remote(self) -> None:
        """Sends the queued pages (bounded wait) and disconnects from the shared tier."""
        for store in self.remote:
            store.close()

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
        hits, host_hits = self._match_prefix(ctx, req, num_steps)
        plan = self._reservation(ctx, req, num_steps, hits, host_hits)
        # The shared tier is asked only when the request fits without it, for the reason
        # the host walk is (see _match_prefix): its hits turn fresh pages into loaded
        # ones (as many device pages), so a request that waits for pages would only fetch
        # the same bytes again at every retry.
        if self.remote and self.fits([plan]):
            remote_hits = self._match_remote(ctx, req, hits, host_hits)
            if remote_hits:
                plan = self._reservation(ctx, req, num_steps, hits, host_hits, remote_hits)
        return plan

    def _reservation(
        self,
        ctx: TextGenerationContext,
        req: _Request,
        num_steps: int,
        hits: list[tuple[int, int]],
        host_hits: list[_Load] | None = None,
        remote_hits: list[_Load] | None = None,
    ) -> Reservation:
        """The reservation of `ctx` with these hits: where its cache ends and how many
        fresh pages it takes. Raises SequenceTooLongError past `max_seq_len`."""
        host_hits, remote_hits = host_hits or [], remote_hits or []
        num_hits = len(hits) + len(host_hits) + len(remote_hits)
        hit_tokens = (len(req.hashes) + num_hits) * self.page_size if num_hits else ctx.start_idx
        # Where the window ends after a hit is the context's rule, not the manager's.
        active_idx = ctx.active_idx_after_skip(hit_tokens) if num_hits else ctx.active_idx
        needed_pages = _ceil_div(self._check_length(ctx, num_steps, active_idx), self.page_size)
        num_new = max(needed_pages - len(req.pages) - num_hits, 0)
        return Reservation(ctx, req, hits, hit_tokens, num_new, host_hits, remote_hits)

    def fits(self, plans: list[Reservation]) -> bool:
        """Whether the pool can take every plan's hits and fresh pages (host and remote
        hits included: each needs a device page) at once."""
        hit_pages = [page_id for plan in plans for page_id, _ in plan.hits]
        return self.pool.can_take(hit_pages, sum(p.num_new + p.num_loads for p in plans))

    def apply(self, plans: list[Reservation]) -> None:
        """Takes the pages of `plans` (which `fits`), then moves each hit context's window.

        If a context's own `skip_cached_prefix` raises, the plans whose contexts did not
        move give their pages back (cached pages evicted to make room stay evicted).

        Host hits: each takes a fresh device page and becomes a pending load that pins its
        host page. Taking device pages never evicts a host page (host pages are evicted
        only by `commit`'s write-through, which skips pinned ones), so the host hits of
        every plan are safe from the moment they were matched (TensorRT-LLM #12878).
        """
        hit_pages = [page_id for plan in plans for page_id, _ in plan.hits]
        new_pages = self.pool.take(hit_pages, sum(p.num_new + p.num_loads for p in plans))
        if new_pages is None:
            raise InvariantError("a reservation that fits could not take its pages")
        if self._min_hits:
            self._count_hits(plans, new_pages)
        sizes = []
        for plan in plans:
            req, taken = plan.req, [page_id for page_id, _ in plan.hits]
            num_loads = plan.num_loads
            load_pages = new_pages[:num_loads]
            taken += new_pages[: num_loads + plan.num_new]
            del new_pages[: num_loads + plan.num_new]
            sizes.append((len(req.pages), len(req.hashes), len(req.loads), len(req.remote_loads)))
            req.pages.extend(taken)
            req.hashes.extend(page_hash for _, page_hash in plan.hits)
            req.hashes.extend(load.page_hash for load in plan.host_hits)
            req.hashes.extend(load.page_hash for load in plan.remote_hits)
            for load, page_id in zip(plan.host_hits, load_pages):
                req.loads.append(replace(load, device_page=page_id))
                self._pinned[load.host_page] += 1
            req.remote_loads.extend(replace(load, device_page=page_id) for load, page_id in
                                    zip(plan.remote_hits, load_pages[len(plan.host_hits):]))
            self._page_table[req.slot, : len(req.pages)] = req.pages
        for done, plan in enumerate(plans):
            if not plan.hits and not plan.num_loads:
                continue
            skipped = plan.hit_tokens - plan.ctx.start_idx
            try:
                plan.ctx.skip_cached_prefix(plan.hit_tokens)
            except BaseException:
                self._give_back(plans[done:], sizes[done:])
                raise
            self.cache_tokens += skipped
            self.input_tokens += skipped
            self.host_cache_tokens += len(plan.host_hits) * self.page_size
            self.remote_cache_tokens += len(plan.remote_hits) * self.page_size
        if self.host is not None:  # device hits keep their host copies young too
            self.host.touch_hashes(h for plan in plans for _, h in reversed(plan.hits))

    def _count_hits(self, plans: list[Reservation], new_pages: list[int]) -> None:
        """`host_kvcache_min_hits`: fresh pages start at 0 hits; a device hit that reaches
        the threshold queues its page for the next `commit`'s write-through."""
        hits = self._page_hits
        for page_id in new_pages:
            hits[page_id] = 0
        for plan in plans:
            req = plan.req
            parent = req.hashes[-1] if req.hashes else None
            for page_id, page_hash in plan.hits:
                hits[page_id] += 1
                if hits[page_id] == self._min_hits:
                    salt = getattr(plan.ctx, "cache_salt", None) if parent is None else None
                    self._promoted.append((page_id, page_hash, parent, salt))
                parent = page_hash

    def _give_back(self, plans: list[Reservation],
                   sizes: list[tuple[int, int, int, int]]) -> None:
        for plan, (num_pages, num_hashes, num_loads, num_remote) in zip(plans, sizes):
            req = plan.req
            self.pool.release(reversed(req.pages[num_pages:]))
            del req.pages[num_pages:]
            del req.hashes[num_hashes:]
            self._pinned.subtract(load.host_page for load in req.loads[num_loads:])
            self._pinned += Counter()
            del req.loads[num_loads:]
            del req.remote_loads[num_remote:]

    def load_pending(self, batch: list[TextGenerationContext]) -> None:
        """Copies the host and remote hits of `batch`'s requests into their device pages
        (one batched copy per device and tier), then indexes those pages on the device
        and unpins the host pages. All or nothing: the copies only write pages the
        requests own, so a failure before the index changes leaves the loads pending, to
        run again."""
        reqs = [self._requests[ctx.request_id] for ctx in batch]
        host_loads = [load for req in reqs for load in req.loads]
        remote_loads = [load for req in reqs for load in req.remote_loads]
        loads = host_loads + remote_loads
        if not loads:
            return
        if host_loads:
            assert self.host_pages is not None
            self.host_pages.load([ld.host_page for ld in host_loads], self.blocks,
                                 [ld.device_page for ld in host_loads])
        if remote_loads:
            self._load_remote(remote_loads)
        self.pool.commit_pages(
            [ld.device_page for ld in loads], [ld.page_hash for ld in loads],
            [ld.token_bytes for ld in loads], [ld.parent_hash for ld in loads],
            [ld.cache_salt for ld in loads],
        )
        for req in reqs:
            req.loads.clear()
            req.remote_loads.clear()
        self._pinned.subtract(ld.host_page for ld in host_loads)
        self._pinned += Counter()

    def _load_remote(self, loads: list[_Load]) -> None:
        """The validated bytes of remote hits -> their device pages, shard by shard."""
        device_pages = [ld.device_page for ld in loads]
        for shard, block in enumerate(self.blocks):
            write_pages([ld.shards[shard] for ld in loads], block, device_pages,
                        self._block_views)
        self.bytes_from_remote += sum(page.nbytes for ld in loads for page in ld.shards)

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

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix in both tiers (pending loads still complete)."""
        self.pool.reset_prefix_cache()
        if self.host is not None:
            self.host.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.pool.check_invariants(req.pages for req in self._requests.values())
        for request_id, req in self._requests.items():
            if len(req.hashes) > len(req.pages):
                raise InvariantError(f"request {request_id!r} has more hashes than pages")
        if self.host is not None:
            self.host.check_invariants()
        self.check_loads()

    def check_loads(self) -> None:
        """InvariantError unless every pending load reads a host page still holding its
        tokens (or unhashed by a reset, and then pinned), writes a page its request owns
        without a hash, and `_pinned` counts exactly the pending loads."""
        pins: Counter[int] = Counter()
        for request_id, req in self._requests.items():
            for load in req.loads:
                pins[load.host_page] += 1
                host = self.host
                assert host is not None
                h = host.page_hash(load.host_page)
                if h is not None and (h != load.page_hash
                                      or host.page_tokens(load.host_page) != load.token_bytes):
                    raise InvariantError(
                        f"request {request_id!r} would load host page {load.host_page}, "
                        f"which now holds other tokens (hash {h}, expected {load.page_hash})"
                    )
                device_page = load.device_page
                if device_page not in req.pages or self.pool.page_hash(device_page) is not None:
                    raise InvariantError(
                        f"request {request_id!r} loads into device page {load.device_page}, "
                        "which it does not own or which is hashed"
                    )
        if pins != self._pinned:
            raise InvariantError(f"host pins {dict(self._pinned)} but pending loads {dict(pins)}")
