"""The hash chains of a paged replica's requests: where each one is rooted, and the
pages of the device index that continue it.

A request's chain continues from its last committed page: the first page chains from
the root of the request's cache salt and LoRA adapter (`mokv.cache.extra_keys.chain_root`),
or from the replica's root without them; a page an image overlaps is keyed by it too
(`extra_keys.page_keys`). Everything besides the tokens comes from one function,
`extra_keys.hash_inputs(ctx)`. Prefix matching runs only when every page the request
holds is committed and its cache ends exactly at their end (a new request, or one whose
cache ends on a page boundary after a chunk or a reset); it stops one token short of
`end_idx`, since the model must run on the last token.
"""

from __future__ import annotations

from collections.abc import Iterator

from ...cache.extra_keys import HashInputs, chain_root, hash_inputs, page_keys
from ...cache.hashing import PageHashFn, iter_page_hashes
from ...cache.page_pool import PagePool
from ...context import TextGenerationContext
from ...params import KVCacheParams
from ...tiers.base import ChainTail
from ..base import integer_tokens
from .plans import RequestState

KEYED_ROOTS_MEMO = 65536
"""(salt, adapter) pairs whose roots are remembered (then forgotten all at once): bounds
the memo, not the keys."""


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
        # (cache_salt, lora_name) -> the root of their hash chains
        self._keyed_roots: dict[tuple[str | None, str | None], int] = {}

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
            root = self._keyed_roots[key] = chain_root(p.prefix_hash, p.prefix_hash_seed, *key)
        return root

    def pages(
        self, ctx: TextGenerationContext, req: RequestState, end_page: int
    ) -> Iterator[tuple[int, bytes]]:
        """(hash, token bytes) of the request's full pages after its committed ones, up
        to page `end_page` (excluded); TypeError for tokens that are not integers
        (`integer_tokens`)."""
        inputs = hash_inputs(ctx)
        first = len(req.hashes)
        keys = page_keys(inputs.mm_inputs, self.page_size, first, end_page) if inputs else None
        return iter_page_hashes(
            integer_tokens(ctx),
            self.page_size,
            self.parent(req, inputs),
            self._hash_fn,
            first,
            end_page,
            keys,
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
