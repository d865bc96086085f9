"""The hash chains of a paged replica's requests: where each one is rooted, and the
pages of the device index that continue it.

A request's chain continues from its last committed page: the first page chains from
the root of the request's `cache_salt` (`mokv.cache.hashing.salted_root`), or from the
replica's root without a salt. Prefix matching runs only when every page the request
holds is committed and its cache ends exactly at their end (a new request, or one whose
cache ends on a page boundary after a chunk or a reset); it stops one token short of
`end_idx`, since the model must run on the last token.
"""

from __future__ import annotations

from collections.abc import Iterator

from ...cache.hashing import PageHashFn, iter_page_hashes, salted_root
from ...cache.page_pool import PagePool
from ...context import TextGenerationContext, cache_salt_of
from ...params import KVCacheParams
from ...tiers.base import ChainTail
from ..base import integer_tokens
from .plans import RequestState

SALTED_ROOTS_MEMO = 65536
"""Salts whose roots are remembered (then forgotten all at once): bounds the memo, not
the salts."""


class PrefixChains:
    """Pure queries over one replica's device index (`pool`)."""

    def __init__(
        self, params: KVCacheParams, pool: PagePool, hash_fn: PageHashFn, root_hash: int
    ) -> None:
        self.params = params
        self.page_size = params.page_size
        self.pool = pool
        self._hash_fn = hash_fn
        self._root_hash = root_hash
        self._salted_roots: dict[str, int] = {}  # cache_salt -> root of its hash chains

    def can_match(self, ctx: TextGenerationContext, req: RequestState) -> bool:
        """Whether a prefix may extend the request now (see the module docstring)."""
        n_committed = len(req.hashes)
        return (
            self.params.enable_prefix_caching
            and len(req.pages) == n_committed
            and ctx.start_idx == n_committed * self.page_size
        )

    def parent(self, req: RequestState, ctx: TextGenerationContext) -> int:
        """The hash the request's next page chains from."""
        if req.hashes:
            return req.hashes[-1]
        salt = cache_salt_of(ctx)
        if salt is None:
            return self._root_hash
        root = self._salted_roots.get(salt)
        if root is None:
            if len(self._salted_roots) >= SALTED_ROOTS_MEMO:
                self._salted_roots.clear()
            p = self.params
            root = self._salted_roots[salt] = salted_root(p.prefix_hash, p.prefix_hash_seed, salt)
        return root

    def pages(
        self, ctx: TextGenerationContext, req: RequestState, end_page: int
    ) -> Iterator[tuple[int, bytes]]:
        """(hash, token bytes) of the request's full pages after its committed ones, up
        to page `end_page` (excluded); TypeError for tokens that are not integers
        (`integer_tokens`)."""
        return iter_page_hashes(
            integer_tokens(ctx),
            self.page_size,
            self.parent(req, ctx),
            self._hash_fn,
            len(req.hashes),
            end_page,
        )

    def device_hits(
        self, ctx: TextGenerationContext, req: RequestState, want_tail: bool
    ) -> tuple[list[tuple[int, int]], ChainTail | None]:
        """(page id, hash) of indexed device pages that continue the request's committed
        pages, and, if `want_tail`, the rest of the chain from the first page the device
        lacks (None when nothing is left to look for). Pure."""
        hits: list[tuple[int, int]] = []
        if not self.can_match(ctx, req):
            return hits, None
        pages = self.pages(ctx, req, (ctx.end_idx - 1) // self.page_size)
        for page_hash, data in pages:
            page_id = self.pool.lookup(page_hash, data)
            if page_id is None:
                return hits, ChainTail((page_hash, data), pages) if want_tail else None
            hits.append((page_id, page_hash))
        return hits, None
