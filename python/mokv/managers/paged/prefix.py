"""The hash chains of a paged replica's requests: where each one is rooted, and the
pages of the device index that continue it.

A request's chain continues from its last committed page: the first page chains from
the root of the request's cache salt and LoRA adapter (`mokv.cache.extra_keys.chain_root`),
or from the replica's root without them; a page an image overlaps is keyed by it too
(`extra_keys.page_keys`). Everything besides the tokens comes from one function,
`extra_keys.hash_inputs(ctx)`; a keyed request's pages carry their keys in their token
bytes (`extra_keys.KeyedTokens`), so a hit confirms them. Prefix matching runs only
when every page the request holds is committed and its cache ends exactly at their end
(a new request, or one whose cache ends on a page boundary after a chunk or a reset); it
stops one token short of `end_idx`, since the model must run on the last token.

Chains are hashed once per request and kept in a `ChainMemo` (chain_memo.py, with the
device hits last found, the room they left and the last refusal), so that a prompt
retried at every step until it fits, and the commits of its pages after it does, hash
it once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...cache.extra_keys import HashInputs, chain_root, hash_inputs, keyed_pages, page_keys
from ...cache.hashing import TOKEN_BYTES, PageHashFn, iter_page_hashes
from ...cache.page_pool import PagePool
from ...config.params import KVCacheParams
from ...context import RequestID, TextContext, TextGenerationContext
from ...tiers.base import ChainTail
from ..base import integer_tokens
from .chain_memo import ChainEntry, ChainMemo, Hits, Page, Refusal, Room
from .plans import RequestState, Reservation

KEYED_ROOTS_MEMO = 65536
"""(salt, adapter) pairs whose roots are remembered (then forgotten all at once): bounds
the memo, not the keys."""

CHAIN_MEMO_TOKENS = 1 << 17
"""Tokens of the chains a replica remembers (`ChainMemo`), about 16 bytes each."""


class PrefixChains:
    """Pure queries over one replica's device index (`pool`)."""

    def __init__(
        self,
        params: KVCacheParams,
        pool: PagePool,
        hash_fn: PageHashFn,
        root_hash: int,
        max_seq_len: int,
    ) -> None:
        self.params = params
        self.page_size = params.page_size
        self.max_seq_len = max_seq_len  # what a refused retry may reserve (`refused_again`)
        self.pool = pool
        self._hash_fn = hash_fn
        self._root_hash = root_hash
        # (cache_salt, lora_name) -> the root of their hash chains
        self._keyed_roots: dict[tuple[str | None, str | None], int] = {}
        self.memo = ChainMemo(CHAIN_MEMO_TOKENS)

    def can_match(self, ctx: TextGenerationContext, req: RequestState) -> bool:
        """Whether a prefix may extend the request now (see the module docstring)."""
        n_committed = len(req.hashes)
        return (
            self.params.enable_prefix_caching
            and len(req.pages) == n_committed
            and ctx.start_idx == n_committed * self.page_size
        )

    def parent(self, req: RequestState, inputs: HashInputs | None) -> int:
        """The hash the request's next page chains from (`inputs`: its `hash_inputs`)."""
        if req.hashes:
            return req.hashes[-1]
        if inputs is None or inputs.cache_salt is None and inputs.lora_name is None:
            return self._root_hash
        key = (inputs.cache_salt, inputs.lora_name)
        root = self._keyed_roots.get(key)
        if root is None:
            if len(self._keyed_roots) >= KEYED_ROOTS_MEMO:
                self._keyed_roots.clear()
            p = self.params
            root = self._keyed_roots[key] = chain_root(
                p.prefix_hash, p.prefix_hash_seed, *key, page_format=p.page_format
            )
        return root

    def pages(
        self, ctx: TextGenerationContext, req: RequestState, end_page: int
    ) -> tuple[list[Page], ChainEntry | None]:
        """(hash, token bytes) of the request's full pages after its committed ones, up
        to page `end_page` (excluded), and the memo entry that holds them all (None when
        it does not). The list may be the entry's own: read it, never change it. TypeError
        for tokens that are not integers (`integer_tokens`).

        Pages the request's memo entry holds for the same tokens and `hash_inputs` (its
        `ChainKey`) are taken from it; the rest are hashed. A chain from the first page
        is remembered; a single page after committed ones is hashed, not looked up."""
        first, ps = len(req.hashes), self.page_size
        tokens = integer_tokens(ctx)
        if end_page <= first:
            return [], None
        inputs = hash_inputs(ctx)
        if end_page == first + 1 and first and inputs is None:
            # The one page after committed ones that a decode step fills: hashed at once
            # (with "xxh3" ~0.3 us), where reading it from the memo cost ~1 us.
            data = np.ascontiguousarray(tokens[first * ps : end_page * ps], TOKEN_BYTES).tobytes()
            return [(self._hash_fn(req.hashes[-1], data), data)], None
        parent = self.parent(req, inputs)
        entry = self.memo.get(ctx.request_id)
        held = entry.matching_pages(inputs, parent, tokens, ps, first, end_page) if entry else 0
        if entry is not None and held == end_page - first:
            if first == 0 and held == len(entry.pages):
                return entry.pages, entry
            return entry.pages[first:end_page], entry
        start = entry.pages[first + held - 1][0] if entry is not None and held else parent
        keys = page_keys(inputs.mm_inputs, ps, first + held, end_page) if inputs else None
        pages = list(
            iter_page_hashes(tokens, ps, start, self._hash_fn, first + held, end_page, keys)
        )
        if inputs is not None:  # a hit must match its keys too, not only its hash
            pages = keyed_pages(pages, inputs, keys, first + held)
        if held:
            pages[:0] = entry.pages[first : first + held]  # type: ignore[union-attr]
        if first:
            return pages, None
        # The pages' bytes joined are the tokens' bytes (a copy, not a join of slices).
        data = np.ascontiguousarray(tokens[: end_page * ps], dtype=TOKEN_BYTES).tobytes()
        entry = ChainEntry(inputs, parent, data, pages)
        self.memo.put(ctx.request_id, entry)
        return pages, entry

    def device_hits(
        self, ctx: TextGenerationContext, req: RequestState, want_tail: bool
    ) -> tuple[list[tuple[int, int]], ChainTail | None]:
        """(page id, hash) of indexed device pages that continue the request's committed
        pages, and, if `want_tail`, the rest of the chain from the first page the device
        lacks (None when nothing is left to look for). Pure but for the memo; the hits
        list may be the memo's: read it, never change it.

        The hits last found for the same pages are reused, without looking them up, up
        to the first that no longer holds, when the page after them misses
        (`chain_memo`); without a tail, only the tokens of those pages are compared
        with the memo's (`_memo_hits`)."""
        if not self.can_match(ctx, req):
            return [], None
        first, end = len(req.hashes), (ctx.end_idx - 1) // self.page_size
        if first and end <= first:
            # A decode step onto a fresh page: no page to look for. (Its tokens were
            # checked when its committed pages were hashed.)
            return [], None
        if not want_tail:
            found = self._memo_hits(self.memo.get(ctx.request_id), ctx, req, first, end)
            if found is not None:
                return found, None
        pages, entry = self.pages(ctx, req, end)
        pool = self.pool
        known = entry.hits if entry is not None else None
        hits: list[tuple[int, int]] | None = None
        if entry is not None and known is not None and (known.first, known.end) == (first, end):
            held = known.num_holding(pool)
            hits = self._cut(entry, known, held, pages[held] if held < len(pages) else None)
        if hits is None:
            hits = pool.lookup_run(pages)
            if entry is not None:
                page_ids, hashes = [p for p, _ in hits], [h for _, h in hits]
                tokens = pool.pages_tokens(page_ids)
                entry.hits = Hits(first, end, hits, page_ids, hashes, tokens, pool.num_unindexed)
        n = len(hits)
        if n == len(pages) or not want_tail:
            return hits, None
        return hits, ChainTail(pages[n], iter(pages[n + 1 :]))

    def note_refusal(self, ctx: TextGenerationContext, num_steps: int, plan: Reservation) -> None:
        """Remembers that `plan`, a reservation of `ctx` on a request holding no page, was
        refused with its hits (the memo's list, `device_hits`), for `refused_again`. Only
        a `TextContext`'s: its window after a hit (`active_idx_after_skip`) is a function
        of its indices, and so are the fresh pages it wants."""
        entry = self.memo.get(ctx.request_id)
        if entry is None or entry.hits is None or entry.hits.hits is not plan.hits:
            return
        if ctx.__class__ is TextContext:
            window = (ctx.start_idx, ctx.active_idx, ctx.end_idx, num_steps)
            entry.refusal = Refusal(plan, window)

    def refused_again(
        self, ctx: TextGenerationContext, req: RequestState, num_steps: int
    ) -> Reservation | None:
        """The refused plan of reserving `ctx` for `num_steps` steps, on a request holding
        no page, when it is refused again as it was last (`note_refusal`); None when that
        is not known. Planning it would find the hits `_memo_hits` finds: the very list
        of the refusal (the same fresh pages wanted: the same plan, read for this
        context and room), or another (cut by evictions since: the fresh pages counted
        as a plan counts them, `RequestState.reservation_size`, in a plan without a
        lookup); the room is read again. A prompt waiting for pages is retried at every
        step, and building its plan was most of each retry; the hits are read the short
        way (`_hits_stand`) while nothing they depend on changed."""
        entry = self.memo.get(ctx.request_id)
        if entry is None or entry.refusal is None or req.pages or ctx.__class__ is not TextContext:
            return None
        refusal = entry.refusal
        # The same window on a request without pages (so without hashes) can match a
        # prefix (`can_match`) as it could when it was refused.
        if refusal.window != (ctx.start_idx, ctx.active_idx, ctx.end_idx, num_steps):
            return None
        plan = refusal.plan
        end = (ctx.end_idx - 1) // self.page_size
        known = plan.hits
        hits: Sequence[tuple[int, int]] | None = known
        if not self._hits_stand(entry, known, ctx, end):
            hits = self._memo_hits(entry, ctx, req, 0, end)
        if hits is None:
            return None
        if hits is known:
            room = self._room(entry, hits, plan.num_fresh)
            if plan.num_fresh <= room:
                return None
            plan.ctx, plan.req, plan.room = ctx, req, room  # this retry's
            return plan
        hit_tokens, need = req.reservation_size(
            ctx, len(hits), num_steps, self.page_size, self.max_seq_len
        )
        room = self._room(entry, hits, need)
        if need <= room:
            return None
        refusal.plan = Reservation(ctx, req, hits, hit_tokens, need, [], None, room)
        return refusal.plan

    def _hits_stand(
        self, entry: ChainEntry, hits: Sequence[tuple[int, int]], ctx: TextContext, end: int
    ) -> bool:
        """Whether `_memo_hits(entry, ctx, req, 0, end)` would give `hits` (a refusal's,
        on a request holding no page) back, read the short way: they are still the
        memo's run over pages `[0, end)` and all of them hold (`Hits.num_holding`, asked
        only when an index entry was removed since), the request is a plain one (no
        salt, adapter or image: its chain starts at the replica's root), the bytes of its
        tokens over the hit pages and the page after them are the memo's, and that page
        still misses. That is what `_memo_hits` reads, less its generic steps: a
        `TextContext`'s tokens are int64 ids (`integer_tokens`), a request without pages
        chains from a root (`parent`), and the compare needs no copy
        (`ChainEntry.matching_pages`). False: ask `_memo_hits`.

        A prompt that does not fit is retried at every step; this is most of a retry."""
        known, pool = entry.hits, self.pool
        if known is None or known.hits is not hits or known.first or known.end != end:
            return False
        held = len(hits)
        if held and known.unindexed != pool.num_unindexed and known.num_holding(pool) != held:
            return False
        if entry.key is not None or entry.root != self._root_hash or hash_inputs(ctx) is not None:
            return False
        decided = held + 1 if held < end else end
        tokens = ctx.tokens[: decided * self.page_size]
        if tokens.dtype is not TOKEN_BYTES or not entry.data.startswith(tokens):  # type: ignore[arg-type]
            return False
        return held == end or pool.lookup(*entry.pages[held]) is None

    def _memo_hits(
        self,
        entry: ChainEntry | None,
        ctx: TextGenerationContext,
        req: RequestState,
        first: int,
        end: int,
    ) -> list[tuple[int, int]] | None:
        """The device hits over pages `[first, end)` from the memo's (`entry`, the
        request's), when it has them for these pages (None: look them up). Only the
        pages that decide the run are compared
        with the memo's tokens: the hits that still hold and the page after them. A prompt
        retried at every step while it waits compares its few hits, not all its tokens.

        Later pages decide nothing: the run stops at the first miss. Whatever they hold,
        `pages` + `lookup_run` would find the same run (their bytes are compared in full
        when they are committed: `pages`)."""
        known = entry.hits if entry is not None else None
        if entry is None or known is None or known.first != first or known.end != end:
            return None
        tokens = integer_tokens(ctx)
        held = known.num_holding(self.pool)
        decided = min(first + held + 1, end)
        inputs = hash_inputs(ctx)
        parent = self.parent(req, inputs)
        ps = self.page_size
        if entry.matching_pages(inputs, parent, tokens, ps, first, decided) != decided - first:
            return None
        return self._cut(
            entry, known, held, entry.pages[decided - 1] if held < end - first else None
        )

    def _cut(
        self, entry: ChainEntry, known: Hits, held: int, next_page: Page | None
    ) -> list[tuple[int, int]] | None:
        """The memo's hits cut to the `held` that still hold, when `next_page` (the page
        after them, None at the chain's end) misses; else None (the index gained it: look
        the run up)."""
        if next_page is not None and self.pool.lookup(*next_page) is not None:
            return None
        if held < len(known.hits):  # hits evicted since: the run stops at the first now
            entry.hits = known = known.truncated(held, self.pool)
        return known.hits

    def room(self, request_id: RequestID, hits: list[tuple[int, int]], need: int) -> int:
        """`pool.room` of the hits' pages, or a bound of it below `need` (the fresh pages
        a reservation with these hits takes): the pool's free pages (taking hits only
        revives some of them), or the room last read for the same hits (the memo's
        list, `device_hits`) when the pool freed no page since (`chain_memo`). Either
        way a reservation that needs `need` fresh pages fits exactly when `need` is at
        most the answer.

        Reading the room is a pass over the hits; a prompt that waits for pages is
        retried at every step, and nine retries in ten need more than the free pages."""
        if not hits:  # nothing to revive, read at once (every decode step onto a new page)
            return self.pool.room(())
        return self._room(self.memo.get(request_id), hits, need)

    def _room(self, entry: ChainEntry | None, hits: Sequence[tuple[int, int]], need: int) -> int:
        """`room` with the request's memo entry."""
        pool = self.pool
        free = pool.num_free
        if need > free:
            return free
        known = entry.room if entry is not None else None
        if known is not None and known.hits is hits and known.freed == pool.num_freed:
            if need > known.room:
                return known.room
        memo_hits = entry.hits if entry is not None else None
        if memo_hits is not None and memo_hits.hits is hits:
            room = pool.room(memo_hits.page_ids)
            entry.room = Room(hits, pool.num_freed, room)  # type: ignore[union-attr]
            return room
        return pool.room([page_id for page_id, _ in hits])
