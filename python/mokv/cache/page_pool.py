"""PagePool: the pages of one cache replica, their reference counts and the prefix index.

Every page is in exactly one of five states:

    free    ref 0, no hash         in `_free` (a stack: the most recently freed page is
                                   reused first, which keeps the working set small)
    cached  ref 0, hashed          in `_cached` (LRU order, oldest first); still findable
                                   through the prefix index until it is evicted
    kept    ref 0, hashed, its     in `_kept` (LRU order): a cached page that a session
            hash retained          retains (`retain`; `mokv.SessionConfig`)
    pinned  ref 0, hashed, its     in `_pinned` (LRU order): a cached page a live pin
            hash pinned            holds (`pin`; `mokv.PinConfig`): never evicted, unless
                                   `spill` says a lower tier holds it pinned too, and then
                                   only after every kept page
    owned   ref >= 1               held by one or more requests; may be hashed

Allocation takes free pages first and evicts cached pages only when no free page is
left, oldest first, and kept pages only when no cached page is left: retention changes
the eviction order, never how many pages an allocation can have. Pins do: a pinned page
is not room, unless it can spill (`spill`: a lower tier, the host tier, holds it).
Owners hand pages back in the order they want them evicted: the managers release a
request's pages tail first, so a shared prompt prefix outlives the suffixes that extend
it (the eviction order of vLLM's `FreeKVCacheBlockQueue`).

Retention is by hash (`_retained`): a retained hash's page is kept whenever it has no
owner, whichever page holds it (one recomputed or loaded back after an eviction too).

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
  4. cached and kept pages are hashed, free pages are not; the index maps each hash to a
     page carrying exactly that hash, and every hashed page is in the index.
  5. a pinned page's hash is pinned; a kept page's is retained and not pinned; a cached
     page's is neither (`Retention.lru`).

Every change is all or nothing: a call first works out what it will do (and raises, or
returns None, before touching anything), then applies it with plain list and dict
operations that cannot fail half-way. So an exception from any call, or from anything
it calls, leaves the pool as it was. With an `undo` log (`mokv.undo.UndoLog`, set by
the manager) each change also records there how to undo it, before it tells its event
sink: a manager rolls back a call that raised after a pool call returned. An undone
change restores every page's owners, hash and tokens and the index; the free list and
the LRU may end in another order (evicted pages go back to the old end of the LRU,
revived ones to its young end).

Events. An optional `events` sink (`mokv.events.EventPublisher`, set by the manager
before the pool is used) hears the three changes routers care about, at the one place
each happens: `commit_pages` (stored), eviction of a cached page in `take` (removed) and
`reset_prefix_cache` (cleared). It is told after the pool's state has changed. With no
sink each costs one `is None` test.

Counters. `num_freed` counts pages that lost their last owner or their pin (or became
able to spill: `note_spillable`), `num_unindexed` index
entries removed (evictions, resets); both only grow. Between two readings with both
unchanged, `room(hits)` cannot have grown, and a lookup that found a page still finds it
(the prefix memo, `mokv.managers.paged.chain_memo`, relies on this): every change that
frees a page or removes an index entry must count it, undoing included (an undone
`take` frees its pages, an undone `commit_pages` removes its entries). The hashes of the
last entries removed are logged too (`unindexed_log.py`).

Everything here is plain integers in flat lists: the pool can move to Mojo as it is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, islice
from operator import not_
from typing import TYPE_CHECKING, Protocol

from ..errors import InvariantError
from ..undo import UndoLog
from .retention import Retention
from .unindexed_log import UnindexedLog

if TYPE_CHECKING:
    from .extra_keys import EventKeys

_NO_PAGES: frozenset[int] = frozenset()


class PageEventSink(Protocol):
    """Hears the pool's prefix-cache changes (see `mokv.events.EventPublisher`)."""

    def stored(
        self, page_hash: int, parent_hash: int | None, token_bytes: bytes, keys: EventKeys | None
    ) -> None: ...

    def removed(self, page_hash: int) -> None: ...

    def cleared(self) -> None: ...


class PagePool:
    """Reference-counted pages with an LRU of reusable cached pages (see the module
    docstring); its state is here and in the two helpers that own theirs: `Retention`
    (the LRUs and retained hashes) and `UnindexedLog` (the removed index entries)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got num_pages={num_pages}")
        self.num_pages = num_pages
        self._ref_count = [0] * num_pages
        self._page_hash: list[int | None] = [None] * num_pages
        self._page_tokens: list[bytes | None] = [None] * num_pages
        # Pop from the end; page 0 is handed out first on a fresh pool.
        self._free = list(range(num_pages - 1, -1, -1))
        self._retention = Retention()
        self._cached = self._retention.cached  # the same dicts, read on the hot paths
        self._kept = self._retention.kept
        self._pinned = self._retention.pinned
        self._retained = self._retention.hashes
        self.spill: Callable[[int], bool] | None = None
        """Whether a lower tier holds a pinned hash pinned too (the host tier's, set by
        the replica): then its page may leave the device, after every kept page."""
        self.num_spilled = 0
        """Pinned pages evicted to a lower tier that holds them."""
        self._index: dict[int, int] = {}
        self.num_evicted_retained = 0
        """Kept pages evicted (no free or cached page was left): pages lost by a session."""
        self.events: PageEventSink | None = None
        self.on_evict: Callable[[list[int]], None] | None = None
        """Told the hashes of the pages `take` or `claim` evicted, after their undo is
        recorded (a recurrent state's checkpoints leave with their boundary pages)."""
        self.undo: UndoLog | None = None
        self.num_freed = 0
        self.unindexed = UnindexedLog()

    # --- queries (change nothing) ---------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages that `allocate` can hand out now: free, cached and kept pages, and pinned
        ones that can spill."""
        num_free = len(self._free) + len(self._cached) + len(self._kept)
        return num_free + len(self._spillable(_NO_PAGES)) if self._pinned else num_free

    @property
    def num_blank(self) -> int:
        """Free pages without a hash: what `take` hands out before it evicts."""
        return len(self._free)

    def eviction_rank(self) -> dict[int, int]:
        """Each evictable unowned hashed page's place in the order `take` evicts them
        (cached pages, oldest first, then kept ones); pinned pages are not in it."""
        order = list(self._cached) + list(self._kept)
        return dict(zip(order, range(len(order))))

    def next_evicted(self) -> int | None:
        """The page `take((), 1)` would evict now: None while a free page is left (or
        only pinned pages could give theirs)."""
        if self._free:
            return None
        return next(iter(self._cached), next(iter(self._kept), None))

    @property
    def num_cached(self) -> int:
        """Pages that hold a reusable prefix but no owner (kept and pinned ones included)."""
        return len(self._cached) + len(self._kept) + len(self._pinned)

    @property
    def num_pinned(self) -> int:
        """Pages without an owner that a live pin holds."""
        return len(self._pinned)

    @property
    def pinned_hashes(self) -> frozenset[int]:
        """The hashes pinned now (indexed or not)."""
        return frozenset(self._retention.pinned_hashes)

    def _spillable(self, revived: Iterable[int]) -> list[int]:
        """The pinned pages, oldest first, not in `revived`, that may leave the device
        (`spill`)."""
        spill = self.spill
        if spill is None:
            return []
        hash_of = self._page_hash
        return [p for p in self._pinned if p not in revived and spill(hash_of[p])]  # type: ignore[arg-type]

    @property
    def num_kept(self) -> int:
        """Pages without an owner that a session retains."""
        return len(self._kept)

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

    def page_of(self, page_hash: int) -> int | None:
        """The page indexed under this hash, None if none is (tokens not compared)."""
        return self._index.get(page_hash)

    def lookup(self, page_hash: int, token_bytes: bytes) -> int | None:
        """The page committed under `page_hash` holding exactly `token_bytes`, if any."""
        page_id = self._index.get(page_hash)
        if page_id is None or self._page_tokens[page_id] != token_bytes:
            return None
        return page_id

    def indexed_hashes(self) -> set[int]:
        """Every hash a lookup can find now (what an event subscriber rebuilds)."""
        return set(self._index)

    def is_cached(self, page_id: int) -> bool:
        """True if the page has no owner but can still be reused through the index."""
        return page_id in self._cached or page_id in self._kept or page_id in self._pinned

    def is_retained(self, page_id: int) -> bool:
        """True if the page's hash is retained (the page is kept whenever unowned)."""
        return self._page_hash[page_id] in self._retained

    @property
    def retained_hashes(self) -> frozenset[int]:
        """The hashes retained now (indexed or not)."""
        return frozenset(self._retained)

    @property
    def num_unindexed(self) -> int:
        """Index entries removed, ever (`UnindexedLog.count`)."""
        return self.unindexed.count

    def unindexed_since(self, reading: int) -> list[int] | None:
        """`UnindexedLog.since`: the hashes unindexed since `num_unindexed` was `reading`."""
        return self.unindexed.since(reading)

    def lookup_run(self, pages: Iterable[tuple[int, bytes]]) -> list[tuple[int, int]]:
        """`(page id, hash)` of the leading `(hash, token bytes)` of `pages` that `lookup`
        finds, up to the first it does not (`lookup`, inlined: one call per prompt)."""
        index, page_tokens, run = self._index, self._page_tokens, []
        for page_hash, token_bytes in pages:
            page_id = index.get(page_hash)
            if page_id is None or page_tokens[page_id] != token_bytes:
                break
            run.append((page_id, page_hash))
        return run

    def pages_tokens(self, page_ids: Iterable[int]) -> list[bytes | None]:
        """`page_tokens` of each page."""
        return list(map(self._page_tokens.__getitem__, page_ids))

    def num_still_indexed(
        self, page_ids: Sequence[int], page_hashes: list[int], token_bytes: list[bytes | None]
    ) -> int:
        """How many leading pages of `page_ids` still carry their hash and exactly their
        token bytes, so that `lookup` of that hash and bytes finds them (invariant 4).
        While all of them do (the usual case), one C-level pass per column, cheaper than
        the lookups it stands for; `token_bytes` as `page_tokens` gave them (equal
        objects compare at once)."""
        hashes = list(map(self._page_hash.__getitem__, page_ids))
        tokens = list(map(self._page_tokens.__getitem__, page_ids))
        held, lost = 0, len(hashes)  # the first `held` hold; the first `lost` do not all
        if hashes == page_hashes and tokens == token_bytes:
            return lost
        # Bisected on C-level comparisons of leading slices: the pages of a waiting
        # prompt are evicted tail first, so a scan from the front would cross most of them.
        while lost - held > 1:
            mid = (held + lost) // 2
            if hashes[:mid] == page_hashes[:mid] and tokens[:mid] == token_bytes[:mid]:
                held = mid
            else:
                lost = mid
        return held

    # --- changes --------------------------------------------------------------------

    def acquire(self, page_id: int) -> None:
        """Adds an owner to a page found through `lookup` (taking it out of the LRU)."""
        self.take((page_id,), 0)

    def room(self, hits: Sequence[int]) -> int:
        """How many fresh pages `take(hits, n)` could hand out: the free and cached pages,
        less the cached ones among `hits` (taking them revives them). Pure."""
        if not hits:
            return self.num_free
        revived = self._revived(hits)
        if self._pinned:
            return self._room(revived)
        return self.num_free - len(revived)

    def _room(self, revived: set[int]) -> int:
        """Fresh pages `take` can hand out once `revived` left their LRUs."""
        room = len(self._free) + len(self._cached) + len(self._kept) - len(revived)
        if self._pinned:  # revived pinned pages were never room
            room += len(revived & self._pinned.keys()) + len(self._spillable(revived))
        return room

    def can_take(self, hits: Sequence[int], num_new: int) -> bool:
        """Whether `take(hits, num_new)` would succeed (pure)."""
        return num_new <= self.room(hits)

    def _revived(self, hits: Sequence[int]) -> set[int]:
        """The pages of `hits` without an owner (they leave the LRU when taken);
        InvariantError unless every one of them is cached."""
        # C-level passes: a prompt's run of hits is read at every retry of its admission.
        revived = set(compress(hits, map(not_, map(self._ref_count.__getitem__, hits))))
        # A dict view's `>=` tests membership of each revived page in C.
        if revived and not self._cached.keys() >= revived:
            if not self._cached.keys() | self._kept.keys() | self._pinned.keys() >= revived:
                raise InvariantError(
                    f"unowned pages {sorted(revived)} taken but not all are cached"
                )
        return revived

    def take(self, hits: Sequence[int], num_new: int) -> list[int] | None:
        """Adds an owner to each page of `hits` (pages found through `lookup`; one may
        appear several times), then hands out `num_new` fresh pages with ref count 1.

        The hits are taken first, so the fresh pages never evict them. Returns the fresh
        pages, or None (and no change) if they do not fit.
        """
        free, cached = self._free, self._cached
        if num_new == 1 and not hits and (free or cached):
            return self._take_one()
        revived = self._revived(hits) if hits else _NO_PAGES
        if self._pinned:
            room = self._room(revived)  # type: ignore[arg-type]
        else:  # `_room` inlined: no pin, as before pins existed
            room = len(free) + len(cached) + len(self._kept) - len(revived)
        if num_new > room:
            return None
        from_free = min(num_new, len(free))
        need = num_new - from_free
        # The oldest cached pages, read unfiltered when none is revived (a decode step's).
        unrevived = (p for p in cached if p not in revived) if revived else cached
        evicted = list(islice(unrevived, need)) if need else []
        num_unretained = len(evicted)
        if need > num_unretained:  # the cached pages ran out: sessions lose kept pages
            evicted += islice((p for p in self._kept if p not in revived), need - num_unretained)
        num_kept = len(evicted) - num_unretained
        if need > len(evicted):  # then pinned pages spill to the tier that holds them
            evicted += self._spillable(revived)[: need - len(evicted)]
        # Everything is decided: apply it.
        for page_id in revived:
            if cached.pop(page_id, self) is self:
                (self._kept if page_id in self._kept else self._pinned).pop(page_id)
        ref_count = self._ref_count
        for page_id in hits:
            ref_count[page_id] += 1
        evicted_hashes = list(map(self._page_hash.__getitem__, evicted)) if evicted else []
        evicted_tokens = list(map(self._page_tokens.__getitem__, evicted)) if evicted else []
        if evicted:
            self._evict(evicted, evicted_hashes, num_unretained, num_kept)
        pages = free[len(free) - from_free :][::-1] + evicted
        del free[len(free) - from_free :]
        for page_id in pages:
            ref_count[page_id] = 1
        if self.undo is not None:
            self.undo.push(
                self._untake,
                list(hits),
                revived,
                tuple(pages),
                from_free,
                evicted_hashes,
                evicted_tokens,
                num_unretained,
                num_kept,
            )
        if self.events is not None:
            for page_hash in evicted_hashes:
                self.events.removed(page_hash)  # type: ignore[arg-type]
        if self.on_evict is not None and evicted_hashes:
            self.on_evict(evicted_hashes)  # type: ignore[arg-type]
        return pages

    def _take_one(self) -> list[int]:
        """`take((), 1)` while a free or cached page is left: the free page, or the oldest
        cached one, evicted; the same state, counters, undo record and event as the
        general path, without its columns. Every decoding request that fills its last
        page takes one (at pages of 16 tokens, one step in sixteen), and a busy replica
        has no free page left: ~0.6 µs here against ~1.8 µs through the general path."""
        if self._free:
            page_id = self._free.pop()
            evicted_hashes: list[int | None] = []
            evicted_tokens: list[bytes | None] = []
        else:
            page_id = next(iter(self._cached))
            evicted_hashes = [self._page_hash[page_id]]
            evicted_tokens = [self._page_tokens[page_id]]
            self._evict([page_id], evicted_hashes, 1, 0)
        self._ref_count[page_id] = 1
        num_evicted = len(evicted_hashes)
        if self.undo is not None:
            self.undo.push(
                self._untake,
                [],
                _NO_PAGES,
                (page_id,),
                1 - num_evicted,
                evicted_hashes,
                evicted_tokens,
                num_evicted,
                0,
            )
        if num_evicted:
            if self.events is not None:
                self.events.removed(evicted_hashes[0])  # type: ignore[arg-type]
            if self.on_evict is not None:
                self.on_evict(evicted_hashes)  # type: ignore[arg-type]
        return [page_id]

    def _evict(
        self, evicted: list[int], hashes: list[int | None], num_unretained: int, num_kept: int
    ) -> None:
        """Takes `evicted` (unowned, hashed: first `num_unretained` cached pages, then
        `num_kept` kept ones, then pinned ones that spill) out of their LRU and the index
        (`take`'s, once it has decided)."""
        index, page_hash, page_tokens = self._index, self._page_hash, self._page_tokens
        lrus = (self._cached, self._kept, self._pinned)
        for i, (page_id, old_hash) in enumerate(zip(evicted, hashes)):
            del lrus[(i >= num_unretained) + (i >= num_unretained + num_kept)][page_id]
            del index[old_hash]  # type: ignore[arg-type]
            page_hash[page_id] = None
            page_tokens[page_id] = None
        self.num_evicted_retained += num_kept
        self.num_spilled += len(evicted) - num_unretained - num_kept
        self.unindexed.note(hashes)  # type: ignore[arg-type]

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
        retained, hash_of, freed = self._retained, self._page_hash, 0
        lru_of = self._retention.lru if self._retention.pinned_hashes else None
        for page_id in page_ids:  # a request's pages: locals only, in the loop
            ref = ref_count[page_id] - 1
            ref_count[page_id] = ref
            if ref == 0:
                freed += 1
                page_hash = hash_of[page_id]
                if page_hash is None:
                    self._free.append(page_id)
                elif lru_of is not None:
                    lru_of(page_hash)[page_id] = None
                elif retained and page_hash in retained:
                    self._kept[page_id] = None
                else:
                    self._cached[page_id] = None
        self.num_freed += freed
        if self.undo is not None:
            self.undo.push(self._unrelease, page_ids)

    def drop(self, page_id: int) -> None:
        """An unowned cached page leaves the index and becomes free (its prefix is of no
        use any more: a checkpoint whose boundary page every group evicted)."""
        page_hash = self._page_hash[page_id]
        if self._ref_count[page_id] or page_id not in self._cached or page_hash is None:
            raise InvariantError(f"page {page_id} is not an unowned cached page to drop")
        if self.undo is not None:
            # the LRU's order whole: drops are rare (a checkpoint pool's, small)
            order = list(self._cached)
            self.undo.push(self._undrop, page_id, page_hash, self._page_tokens[page_id], order)
        del self._cached[page_id]
        del self._index[page_hash]
        self._page_hash[page_id] = self._page_tokens[page_id] = None
        self.unindexed.note([page_hash])
        self._free.append(page_id)
        if self.events is not None:
            self.events.removed(page_hash)

    def release_cold(self, page_ids: Sequence[int]) -> None:
        """`release`, but the hashed pages left without owners join the *old* end of the
        LRU, the first given evicted first: pages their owner knows no later hit is
        likely to read (a sliding window's pages that no joint hit ends after), evicted
        before every page released the usual way."""
        self.release(page_ids)
        cached, ref_count, hash_of = self._cached, self._ref_count, self._page_hash
        for page_id in reversed(page_ids):
            if not ref_count[page_id] and hash_of[page_id] is not None and page_id in cached:
                cached.move_to_end(page_id, last=False)

    def claim(self, page_ids: Sequence[int]) -> None:
        """Adds an owner to each of `page_ids`, which have none (free, cached or kept
        pages; not pinned), taking the hashed ones out of the index as `take` evicts:
        how a budget shared by several pools takes a page's memory for another pool
        (`mokv.managers.paged.groups.budget`). All or nothing; InvariantError, before
        any change, unless every page is unowned and unpinned, each once."""
        ref_count, pinned = self._ref_count, self._pinned
        if len(set(page_ids)) != len(page_ids):
            raise InvariantError(f"pages {list(page_ids)} claimed twice in one call")
        for page_id in page_ids:
            if ref_count[page_id] or page_id in pinned:
                raise InvariantError(f"page {page_id} claimed while owned or pinned")
        hash_of, kept = self._page_hash, self._kept
        unhashed = [p for p in page_ids if hash_of[p] is None]
        evicted = [p for p in page_ids if hash_of[p] is not None and p not in kept]
        num_unretained = len(evicted)
        evicted += [p for p in page_ids if p in kept]
        # Everything is decided: apply it.
        if unhashed:
            claimed = set(unhashed)
            self._free[:] = [p for p in self._free if p not in claimed]
        evicted_hashes = [hash_of[p] for p in evicted]
        evicted_tokens = [self._page_tokens[p] for p in evicted]
        if evicted:
            self._evict(evicted, evicted_hashes, num_unretained, len(evicted) - num_unretained)
        pages = tuple(unhashed + evicted)
        for page_id in pages:
            ref_count[page_id] = 1
        if self.undo is not None:
            self.undo.push(
                self._untake,
                [],
                _NO_PAGES,
                pages,
                len(unhashed),
                evicted_hashes,
                evicted_tokens,
                num_unretained,
                len(evicted) - num_unretained,
            )
        if self.events is not None:
            for page_hash in evicted_hashes:
                self.events.removed(page_hash)  # type: ignore[arg-type]
        if self.on_evict is not None and evicted_hashes:
            self.on_evict(evicted_hashes)  # type: ignore[arg-type]

    def retain(self, page_hashes: Iterable[int]) -> None:
        """Retains these hashes (not retained yet): their unowned pages become kept, the
        first given evicted first among them, and so does any page that holds one of them
        later while unowned (`Retention.retain`). Cannot fail half-way."""
        self._retention.retain(page_hashes, self._index, self.undo)

    def unretain(self, page_hashes: Iterable[int], old_end: bool = True) -> None:
        """Stops retaining these hashes: their kept pages become cached pages at the old
        end of the LRU, or the young end (`Retention.unretain`). Cannot fail half-way."""
        self._retention.unretain(page_hashes, self._index, old_end, self.undo)

    def pin(self, page_hashes: Iterable[int]) -> None:
        """Pins these hashes: their unowned pages become pinned, and so does any page that
        holds one of them later while unowned (`Retention.pin`). Cannot fail half-way."""
        self._retention.pin(page_hashes, self._index, self.undo)

    def unpin(self, page_hashes: Iterable[int]) -> None:
        """Stops pinning these hashes: their unowned pages go to the young end of the LRU
        they belong in now, counted as freed (they are room again). Cannot fail
        half-way."""
        freed = self._retention.unpin(page_hashes, self._index, self.undo)
        self._count_freed(freed)

    def note_spillable(self, page_hashes: Iterable[int]) -> None:
        """A lower tier now holds these hashes (`spill` says so from now on): their
        unowned pinned pages became room, counted as freed."""
        pinned, index = self._pinned, self._index
        self._count_freed(sum(index.get(h, -1) in pinned for h in page_hashes))

    def _count_freed(self, num_pages: int) -> None:
        if num_pages:
            self.num_freed += num_pages
            if self.undo is not None:
                self.undo.push(setattr, self, "num_freed", self.num_freed - num_pages)

    def commit(
        self,
        page_id: int,
        page_hash: int,
        token_bytes: bytes,
        parent_hash: int | None = None,
        keys: EventKeys | None = None,
    ) -> bool:
        """Makes an owned, full page findable under `page_hash`.

        Returns False (and leaves the page unhashed) if another page already holds
        this hash: the index keeps one copy per prefix, and owners' page lists never
        change under them. `parent_hash` (None for a sequence's first page) and `keys`
        (what events say of the page: `mokv.cache.extra_keys.EventKeys`) are only passed
        on to the event sink.
        """
        return self.commit_pages([page_id], [page_hash], [token_bytes], [parent_hash], [keys]) == [
            True
        ]

    def commit_pages(
        self,
        page_ids: Sequence[int],
        page_hashes: Sequence[int],
        token_bytes: Sequence[bytes],
        parent_hashes: Sequence[int | None] | None = None,
        keys: Sequence[EventKeys | None] | None = None,
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
        if self.undo is not None:
            self.undo.push(self._uncommit, [p for p, new in zip(page_ids, indexed) if new])
        if self.events is not None:
            parents = parent_hashes or [None] * len(page_ids)
            page_keys = keys or [None] * len(page_ids)
            for page_hash, data, parent, page_key, new in zip(
                page_hashes, token_bytes, parents, page_keys, indexed
            ):
                if new:
                    self.events.stored(page_hash, parent, data, page_key)
        return indexed

    def reset_prefix_cache(self) -> None:
        """Forgets every hash and retention: cached and kept pages become free, owned pages
        stop being shareable."""
        if self.undo is not None:
            self.undo.push(
                self._unreset,
                [(p, h, self._page_tokens[p]) for h, p in self._index.items()],
                list(self._cached),
                list(self._kept),
                set(self._retained),
                len(self._free),
                list(self._pinned),
                set(self._retention.pinned_hashes),
            )
        for page_id in self._index.values():
            self._page_hash[page_id] = None
            self._page_tokens[page_id] = None
        self.unindexed.clear(len(self._index))
        self._index.clear()
        self._free.extend(self._cached)
        self._free.extend(self._kept)
        self._free.extend(self._pinned)
        self._retention.clear()
        if self.events is not None:
            self.events.cleared()

    # --- undo records (run newest first by `UndoLog.rollback`) -----------------------

    def _untake(
        self,
        hits: list[int],
        revived: set[int],
        pages: tuple[int, ...],
        from_free: int,
        evicted_hashes: list[int],
        evicted_tokens: list[bytes],
        num_unretained: int,
        num_kept: int,
    ) -> None:
        self.num_evicted_retained -= num_kept
        self.num_spilled -= len(evicted_hashes) - num_unretained - num_kept
        self.num_freed += len(pages) + len(revived)
        for page_id in pages:
            self._ref_count[page_id] = 0
        self._free.extend(reversed(pages[:from_free]))
        evicted = pages[from_free:]
        for page_id, page_hash, data in zip(
            evicted[::-1], evicted_hashes[::-1], evicted_tokens[::-1]
        ):
            self._page_hash[page_id] = page_hash
            self._page_tokens[page_id] = data
            self._index[page_hash] = page_id
            lru = self._retention.lru(page_hash)
            lru[page_id] = None
            lru.move_to_end(page_id, last=False)  # they were the oldest
        for page_id in hits:
            self._ref_count[page_id] -= 1
        for page_id in revived:
            self._retention.lru(self._page_hash[page_id])[page_id] = None

    def _undrop(self, page_id: int, page_hash: int, data: bytes | None, order: list[int]) -> None:
        self._free.remove(page_id)
        self._page_hash[page_id] = page_hash
        self._page_tokens[page_id] = data
        self._index[page_hash] = page_id
        self._cached.clear()  # the dict `Retention` shares
        self._cached.update(dict.fromkeys(order))

    def _unrelease(self, page_ids: list[int]) -> None:
        for page_id in reversed(page_ids):
            ref = self._ref_count[page_id]
            if ref == 0:
                page_hash = self._page_hash[page_id]
                if page_hash is None:
                    self._free.pop()  # it was appended last
                else:
                    del self._retention.lru(page_hash)[page_id]
            self._ref_count[page_id] = ref + 1

    def _uncommit(self, page_ids: list[int]) -> None:
        page_hashes = [self._page_hash[page_id] for page_id in page_ids]
        self.unindexed.note(page_hashes)  # type: ignore[arg-type]
        for page_id, page_hash in zip(page_ids, page_hashes):
            del self._index[page_hash]  # type: ignore[arg-type]
            self._page_hash[page_id] = self._page_tokens[page_id] = None

    def _unreset(
        self,
        indexed: list[tuple[int, int, bytes | None]],
        cached: list[int],
        kept: list[int],
        retained: set[int],
        num_free: int,
        pinned: list[int],
        pinned_hashes: set[int],
    ) -> None:
        for page_id, page_hash, data in indexed:
            self._index[page_hash] = page_id
            self._page_hash[page_id] = page_hash
            self._page_tokens[page_id] = data
        del self._free[num_free:]
        self._retention.restore(cached, kept, retained, pinned, pinned_hashes)

    # --- checks ---------------------------------------------------------------------

    def check_invariants(self, owned_pages: Iterable[Iterable[int]]) -> None:
        """Raises InvariantError unless invariants 1-5 hold for these owners' page lists."""
        holders = [0] * self.num_pages
        for pages in owned_pages:
            for page_id in pages:
                holders[page_id] += 1
        free, cached, kept = set(self._free), set(self._cached), set(self._kept)
        pinned = set(self._pinned)
        if len(free) != len(self._free):
            raise InvariantError(f"free list holds duplicates: {sorted(self._free)}")
        states = (("free", free), ("cached", cached), ("kept", kept), ("pinned", pinned))
        for i, (name, a) in enumerate(states):
            for other, b in states[i + 1 :]:
                if a & b:
                    raise InvariantError(f"pages both {name} and {other}: {sorted(a & b)}")
        for page_id in range(self.num_pages):
            ref, h = self._ref_count[page_id], self._page_hash[page_id]
            state = (
                "free"
                if page_id in free
                else "cached"
                if page_id in cached
                else "kept"
                if page_id in kept
                else "pinned"
                if page_id in pinned
                else "owned"
            )
            if ref != holders[page_id]:
                raise InvariantError(
                    f"page {page_id} ({state}) has ref count {ref} but {holders[page_id]} owners"
                )
            if (state == "owned") != (ref > 0):
                raise InvariantError(f"page {page_id} is {state} with ref count {ref}")
            hashed = state in ("cached", "kept", "pinned")
            if hashed and h is None or state == "free" and h is not None:
                raise InvariantError(f"page {page_id} is {state} with hash {h}")
            if h is not None and self._index.get(h) != page_id:
                raise InvariantError(f"page {page_id} has hash {h} but is not indexed under it")
        misfiled = self._retention.misfiled(self._page_hash)
        if misfiled:
            raise InvariantError(
                f"unowned pages {misfiled} are kept without a retained hash or cached with one"
            )
        for h, page_id in self._index.items():
            if self._page_hash[page_id] != h:
                raise InvariantError(
                    f"index maps {h} to page {page_id}, which carries another hash"
                )
