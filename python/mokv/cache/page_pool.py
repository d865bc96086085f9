"""PagePool: the pages of one cache replica, their reference counts and the prefix index.

Every page is in exactly one of three states:

    free    ref 0, no hash         in `_free` (a stack: the most recently freed page is
                                   reused first, which keeps the working set small)
    cached  ref 0, hashed          in `_cached` (LRU order, oldest first); still findable
                                   through the prefix index until it is evicted
    owned   ref >= 1               held by one or more requests; may be hashed

Allocation takes free pages first and evicts cached pages only when no free page is
left, oldest first. Owners hand pages back in the order they want them evicted:
the managers release a request's pages tail first, so a shared prompt prefix outlives
the suffixes that extend it (the eviction order of vLLM's `FreeKVCacheBlockQueue`).

The hash index maps a chained page hash (see `hashing.py`) to the one page committed
under it. When two requests compute the same page at the same time, only the first
committed copy is indexed; `commit` leaves the other an ordinary unhashed page, and its
owner decides what to do with it (the paged replica moves the request onto the indexed
copy and frees its own, as MAX does). Lookups compare the page's token bytes too, so a
hash collision can never hand out the wrong page.

Invariants (checked by `check_invariants`):
  1. free, cached and owned partition the pages; `_free` and `_cached` hold no duplicates.
  2. owned pages have ref >= 1, free and cached pages ref 0.
  3. every page's ref count equals the number of times the owners hold it.
  4. cached pages are hashed, free pages are not; the index maps each hash to a page
     carrying exactly that hash, and every hashed page is in the index.

Every change is all or nothing: a call first works out what it will do (and raises, or
returns None, before touching anything), then applies it with plain list and dict
operations that cannot fail half-way. So an exception from any call, or from anything
it calls, leaves the pool as it was.

Events. An optional `events` sink (`mokv.events.EventPublisher`, set by the manager
before the pool is used) hears the three changes routers care about, at the one place
each happens: `commit_pages` (stored), eviction of a cached page in `take` (removed) and
`reset_prefix_cache` (cleared). It is told after the pool's state has changed. With no
sink each costs one `is None` test.

Counters. `num_freed` counts pages that lost their last owner, `num_unindexed` index
entries removed (evictions, resets); both only grow. Between two readings with both
unchanged, `room(hits)` cannot have grown, and a lookup that found a page still finds it
(the prefix memo, `mokv.managers.paged.chain_memo`, relies on this): every change that
frees a page or removes an index entry must count it.

Everything here is plain integers in flat lists, so that the pool can move to Mojo
without changing its shape.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Protocol

from ..errors import InvariantError


class PageEventSink(Protocol):
    """Hears the pool's prefix-cache changes (see `mokv.events.EventPublisher`)."""

    def stored(
        self, page_hash: int, parent_hash: int | None, token_bytes: bytes, cache_salt: str | None
    ) -> None: ...

    def removed(self, page_hash: int) -> None: ...

    def cleared(self) -> None: ...


class PagePool:
    """Reference-counted pages with an LRU of reusable cached pages."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got num_pages={num_pages}")
        self.num_pages = num_pages
        self._ref_count = [0] * num_pages
        self._page_hash: list[int | None] = [None] * num_pages
        self._page_tokens: list[bytes | None] = [None] * num_pages
        # Pop from the end; page 0 is handed out first on a fresh pool.
        self._free = list(range(num_pages - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._index: dict[int, int] = {}
        self.events: PageEventSink | None = None
        self.num_freed = 0
        self.num_unindexed = 0

    # --- queries (change nothing) ---------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages that `allocate` can hand out now: free and cached pages."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Pages that hold a reusable prefix but no owner."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        """Pages owned by at least one request."""
        return self.num_pages - self.num_free

    def ref_count(self, page_id: int) -> int:
        return self._ref_count[page_id]

    def page_hash(self, page_id: int) -> int | None:
        return self._page_hash[page_id]

    def page_tokens(self, page_id: int) -> bytes | None:
        """The token bytes a hashed page was committed with (None if unhashed)."""
        return self._page_tokens[page_id]

    def lookup(self, page_hash: int, token_bytes: bytes) -> int | None:
        """The page committed under `page_hash` holding exactly `token_bytes`, if any."""
        page_id = self._index.get(page_hash)
        if page_id is None or self._page_tokens[page_id] != token_bytes:
            return None
        return page_id

    def still_indexed(
        self, page_ids: Sequence[int], page_hashes: list[int], token_bytes: list[bytes | None]
    ) -> bool:
        """Whether each page still carries its hash and exactly its token bytes, so that
        `lookup` of that hash and bytes finds it (invariant 4). One C-level pass per
        column, cheaper than the lookups it stands for; `token_bytes` as `page_tokens`
        gave them (equal objects compare at once)."""
        return (
            list(map(self._page_hash.__getitem__, page_ids)) == page_hashes
            and list(map(self._page_tokens.__getitem__, page_ids)) == token_bytes
        )

    def indexed_hashes(self) -> set[int]:
        """Every hash a lookup can find now (what an event subscriber rebuilds)."""
        return set(self._index)

    def is_cached(self, page_id: int) -> bool:
        """True if the page has no owner but can still be reused through the index."""
        return page_id in self._cached

    # --- changes --------------------------------------------------------------------

    def allocate(self, num_pages: int) -> list[int] | None:
        """`num_pages` pages with ref count 1, or None (and no change) if they do not fit."""
        return self.take((), num_pages)

    def acquire(self, page_id: int) -> None:
        """Adds an owner to a page found through `lookup` (taking it out of the LRU)."""
        self.take((page_id,), 0)

    def room(self, hits: Sequence[int]) -> int:
        """How many fresh pages `take(hits, n)` could hand out: the free and cached pages,
        less the cached ones among `hits` (taking them revives them). Pure."""
        return self.num_free - len(self._revived(hits))

    def can_take(self, hits: Sequence[int], num_new: int) -> bool:
        """Whether `take(hits, num_new)` would succeed (pure)."""
        return num_new <= self.room(hits)

    def _revived(self, hits: Sequence[int]) -> set[int]:
        """The pages of `hits` without an owner (they leave the LRU when taken);
        InvariantError unless every one of them is cached."""
        ref_count = self._ref_count
        revived = {p for p in hits if not ref_count[p]}
        # A dict view's `>=` tests membership of each revived page in C.
        if revived and not self._cached.keys() >= revived:
            raise InvariantError(f"unowned pages {sorted(revived)} taken but not all are cached")
        return revived

    def take(self, hits: Sequence[int], num_new: int) -> list[int] | None:
        """Adds an owner to each page of `hits` (pages found through `lookup`; one may
        appear several times), then hands out `num_new` fresh pages with ref count 1.

        The hits are taken first, so the fresh pages never evict them. Returns the fresh
        pages, or None (and no change) if they do not fit.
        """
        revived = self._revived(hits)
        if num_new > self.num_free - len(revived):
            return None
        from_free = min(num_new, len(self._free))
        evicted = (
            list(islice((p for p in self._cached if p not in revived), num_new - from_free))
            if num_new > from_free
            else []
        )
        # Everything is decided: apply it.
        for page_id in revived:
            del self._cached[page_id]
        for page_id in hits:
            self._ref_count[page_id] += 1
        evicted_hashes = [self._page_hash[page_id] for page_id in evicted]
        for page_id, page_hash in zip(evicted, evicted_hashes):
            del self._cached[page_id]
            del self._index[page_hash]  # type: ignore[arg-type]
            self._page_hash[page_id] = None
            self._page_tokens[page_id] = None
        pages = self._free[len(self._free) - from_free :][::-1] + evicted
        del self._free[len(self._free) - from_free :]
        for page_id in pages:
            self._ref_count[page_id] = 1
        self.num_unindexed += len(evicted)
        if self.events is not None:
            for page_hash in evicted_hashes:
                self.events.removed(page_hash)  # type: ignore[arg-type]
        return pages

    def release(self, page_ids: Iterable[int]) -> None:
        """Drops one owner from each page; pages left without owners become reusable.

        Unowned hashed pages join the LRU in the order given, so pass the page to be
        evicted first first.
        """
        page_ids = list(page_ids)
        ref_count = self._ref_count
        if len(set(page_ids)) == len(page_ids):  # the usual case: Counter costs ~1-4 us
            if page_ids and min(map(ref_count.__getitem__, page_ids)) < 1:
                page_id = next(p for p in page_ids if ref_count[p] < 1)
                raise InvariantError(f"page {page_id} released more often than it was acquired")
        else:
            for page_id, times in Counter(page_ids).items():
                if ref_count[page_id] < times:
                    raise InvariantError(f"page {page_id} released more often than it was acquired")
        for page_id in page_ids:
            ref = self._ref_count[page_id] - 1
            self._ref_count[page_id] = ref
            if ref == 0:
                self.num_freed += 1
                if self._page_hash[page_id] is None:
                    self._free.append(page_id)
                else:
                    self._cached[page_id] = None

    def commit(
        self,
        page_id: int,
        page_hash: int,
        token_bytes: bytes,
        parent_hash: int | None = None,
        cache_salt: str | None = None,
    ) -> bool:
        """Makes an owned, full page findable under `page_hash`.

        Returns False (and leaves the page unhashed) if another page already holds
        this hash: the index keeps one copy per prefix, and owners' page lists never
        change under them. `parent_hash` (None for a sequence's first page) and
        `cache_salt` are only passed on to the event sink.
        """
        return self.commit_pages(
            [page_id], [page_hash], [token_bytes], [parent_hash], [cache_salt]
        ) == [True]

    def commit_pages(
        self,
        page_ids: Sequence[int],
        page_hashes: Sequence[int],
        token_bytes: Sequence[bytes],
        parent_hashes: Sequence[int | None] | None = None,
        cache_salts: Sequence[str | None] | None = None,
    ) -> list[bool]:
        """`commit` for several pages at once, all or nothing; True where a page was
        indexed. Pages of one chain come parent first, so that events announce a parent
        before its children."""
        if len(set(page_ids)) != len(page_ids):
            raise InvariantError(f"pages {list(page_ids)} committed twice in one call")
        for page_id in page_ids:
            if self._ref_count[page_id] < 1 or self._page_hash[page_id] is not None:
                raise InvariantError(f"page {page_id} committed while unowned or already hashed")
        indexed, claimed = [], set()
        for page_hash in page_hashes:
            indexed.append(page_hash not in self._index and page_hash not in claimed)
            claimed.add(page_hash)
        for page_id, page_hash, data, new in zip(page_ids, page_hashes, token_bytes, indexed):
            if new:
                self._index[page_hash] = page_id
                self._page_hash[page_id] = page_hash
                self._page_tokens[page_id] = data
        if self.events is not None:
            parents = parent_hashes or [None] * len(page_ids)
            salts = cache_salts or [None] * len(page_ids)
            for page_hash, data, parent, salt, new in zip(
                page_hashes, token_bytes, parents, salts, indexed
            ):
                if new:
                    self.events.stored(page_hash, parent, data, salt)
        return indexed

    def reset_prefix_cache(self) -> None:
        """Forgets every hash: cached pages become free, owned pages stop being shareable."""
        for page_id in self._index.values():
            self._page_hash[page_id] = None
            self._page_tokens[page_id] = None
        self.num_unindexed += len(self._index)
        self._index.clear()
        self._free.extend(self._cached)
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()

    # --- checks ---------------------------------------------------------------------

    def check_invariants(self, owned_pages: Iterable[Iterable[int]]) -> None:
        """Raises InvariantError unless invariants 1-4 hold for these owners' page lists."""
        holders = [0] * self.num_pages
        for pages in owned_pages:
            for page_id in pages:
                holders[page_id] += 1
        free, cached = set(self._free), set(self._cached)
        if len(free) != len(self._free):
            raise InvariantError(f"free list holds duplicates: {sorted(self._free)}")
        if free & cached:
            raise InvariantError(f"pages both free and cached: {sorted(free & cached)}")
        for page_id in range(self.num_pages):
            ref, h = self._ref_count[page_id], self._page_hash[page_id]
            state = "free" if page_id in free else "cached" if page_id in cached else "owned"
            if ref != holders[page_id]:
                raise InvariantError(
                    f"page {page_id} ({state}) has ref count {ref} but {holders[page_id]} owners"
                )
            if (state == "owned") != (ref > 0):
                raise InvariantError(f"page {page_id} is {state} with ref count {ref}")
            if state == "cached" and h is None or state == "free" and h is not None:
                raise InvariantError(f"page {page_id} is {state} with hash {h}")
            if h is not None and self._index.get(h) != page_id:
                raise InvariantError(f"page {page_id} has hash {h} but is not indexed under it")
        for h, page_id in self._index.items():
            if self._page_hash[page_id] != h:
                raise InvariantError(
                    f"index maps {h} to page {page_id}, which carries another hash"
                )
