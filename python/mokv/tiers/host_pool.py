"""HostPagePool: the bookkeeping of a replica's host-memory page tier.

The host tier keeps copies of committed device pages, so that a prefix evicted from the
device can be loaded back instead of recomputed. Pages are written through when `step`
commits them (`HostTier.store`, host.py), never on the device allocation path: evicting
a device page costs nothing, and the allocation path cannot hand out a half-copied page
(TensorRT-LLM #8813 / #12878, see ../shared/notes/kv-events-and-tiers.md §3).

Every host page is in exactly one of three states:

    free     no hash       in `_free` (a stack)
    cached   hashed        in `_lru` (oldest first); findable through the index
    kept     hashed, its   in `_kept` (oldest first): a cached page a session retains
             hash retained  (`retain`; `mokv.SessionConfig`)

A page that a pending load reads is *pinned*. Pins are not stored here: the host tier
counts them and passes the pinned pages (`protected`) to `plan_store`, which
never picks a pinned page, free or cached, as a target or a victim. So a host page is
never overwritten while a load still has to read it, even after `reset_prefix_cache`
made it free.

Eviction is LRU over leaves: a victim is the oldest cached page that no other cached
page names as its parent, so a suffix goes before its prefix (SGLang's radix-cache
rule). Evicting a leaf can make its parent a leaf; if the scan already passed that
parent, it is now the oldest leaf, so it goes next. Kept pages come after every cached
page in that scan: a session's pages go only when nothing else is left. (A session
retains a whole chain from its root, so a kept page's parent is kept too.)

Invariants (checked by `check_invariants`):
  1. free, cached and kept partition the pages; no duplicates.
  2. cached and kept pages are hashed, free pages are not; the index maps each hash to
     a page carrying exactly that hash; every hashed page is indexed.
  3. `_children[h]` is the number of cached and kept pages whose parent hash is `h`.
  4. a kept page's hash is retained, a cached page's is not.

Every change is all or nothing: `plan_store` is pure, and `evict` / `insert` / `touch` /
`reset` apply plain list and dict operations after their checks. With an `undo` log
(`mokv.undo.UndoLog`, set by the host tier) each change also records how to undo it;
an evicted page is restored only if its bytes were not overwritten since (`lose`: the
host tier names the victims it is about to copy over), else it stays evicted and its
removal stays announced.

Events. An optional `events` sink hears `stored` / `removed` (medium "CPU", see
`mokv.events.EventRecorder.medium_sink`) after the change.

Reuse. `mark_loaded` records that a stored page was loaded back; `num_evicted_unused`
counts the pages evicted before that ever happened (copies that cost a write and saved
nothing: a sign the tier is too small or `min_hits` too low).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

from ..cache.extra_keys import EventKeys
from ..cache.page_pool import PageEventSink
from ..cache.retention import Retention
from ..errors import InvariantError
from ..undo import UndoLog
from .host_pool_undo import HostPagePoolUndo


@dataclass(slots=True)
class StorePlan:
    """What writing pages through to the host tier will do (from `plan_store`)."""

    entries: list[int]  # indices into the planned hashes that get a host page, in order
    targets: list[int]  # host page of each entry (free pages first, then victims)
    victims: list[int]  # cached pages evicted to make room, in eviction order
    present: list[int]  # host pages already holding a planned hash (refreshed in the LRU)


class HostPagePool(HostPagePoolUndo):
    """Host pages indexed by chained page hash, with an LRU over leaves (its undo
    records: `host_pool_undo.py`)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a host page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._page_hash: list[int | None] = [None] * num_pages
        self._page_tokens: list[bytes | None] = [None] * num_pages
        self._parent: list[int | None] = [None] * num_pages
        # A stack, popped from the end (page 0 first on a fresh pool).
        self._free = list(range(num_pages - 1, -1, -1))
        self._retention = Retention()
        self._lru = self._retention.cached
        self._kept = self._retention.kept
        self._retained = self._retention.hashes
        self._index: dict[int, int] = {}
        self._children: dict[int, int] = {}
        self._loaded = [False] * num_pages  # loaded back since it was stored
        self.num_evicted_unused = 0
        self.num_evicted_retained = 0  # kept pages evicted: pages a live session lost
        self.events: PageEventSink | None = None
        self.undo: UndoLog | None = None
        self._lost: set[int] = set()  # victims whose bytes were overwritten (a rollback's)

    # --- queries (change nothing) ---------------------------------------------------

    @property
    def num_cached(self) -> int:
        """Host pages holding a committed prefix (kept ones included)."""
        return len(self._lru) + len(self._kept)

    @property
    def num_kept(self) -> int:
        """Host pages that a session retains."""
        return len(self._kept)

    @property
    def retained_hashes(self) -> frozenset[int]:
        """The hashes retained now (stored or not)."""
        return frozenset(self._retained)

    def lookup(self, page_hash: int, token_bytes: bytes) -> int | None:
        """The host page stored under `page_hash` holding exactly `token_bytes`, if any."""
        page_id = self._index.get(page_hash)
        if page_id is None or self._page_tokens[page_id] != token_bytes:
            return None
        return page_id

    def page_of(self, page_hash: int) -> int | None:
        """The host page stored under `page_hash`, if any."""
        return self._index.get(page_hash)

    def page_hash(self, page_id: int) -> int | None:
        return self._page_hash[page_id]

    def page_tokens(self, page_id: int) -> bytes | None:
        return self._page_tokens[page_id]

    def indexed_hashes(self) -> set[int]:
        return set(self._index)

    def plan_store(self, hashes: Sequence[int], protected: Collection[int]) -> StorePlan:
        """Which of `hashes` (pages of hash chains, each parent before its children) get a
        host page, and where. Pure.

        Hashes already stored are refreshed instead; the others take free pages, then
        evict leaves, never a page in `protected` (pinned by a pending load). When room
        runs out the remaining hashes are not stored (a later page of a chain is worth
        less than an earlier one).
        """
        entries, present, seen = [], [], set()
        for i, page_hash in enumerate(hashes):
            page_id = self._index.get(page_hash)
            if page_id is not None:
                present.append(page_id)
            elif page_hash not in seen:
                entries.append(i)
                seen.add(page_hash)
        free = (p for p in reversed(self._free) if p not in protected)
        targets = list(islice(free, len(entries)))
        victims: list[int] = []
        if len(targets) < len(entries):  # never evict a page this store refreshes
            keep = set(present).union(protected) if present else protected
            victims = self._leaf_victims(len(entries) - len(targets), keep)
        targets += victims
        return StorePlan(entries[: len(targets)], targets, victims, present)

    def _leaf_victims(self, num_pages: int, protected: Collection[int]) -> list[int]:
        """Up to `num_pages` cached pages, oldest leaf first (see the module docstring)."""
        victims: list[int] = []
        if num_pages <= 0:
            return victims
        removed_children: dict[int, int] = {}
        taken: set[int] = set()

        def is_leaf(page_id: int) -> bool:
            h = self._page_hash[page_id]
            return self._children.get(h, 0) == removed_children.get(h, 0)  # type: ignore[arg-type]

        def take(page_id: int) -> None:
            victims.append(page_id)
            taken.add(page_id)
            parent = self._parent[page_id]
            if parent is not None:
                removed_children[parent] = removed_children.get(parent, 0) + 1

        passed: set[int] = set()  # pages the scan went over: older than the scan point
        for page_id in itertools.chain(self._lru, self._kept):
            if len(victims) == num_pages:
                break
            passed.add(page_id)
            if page_id in taken or page_id in protected or not is_leaf(page_id):
                continue
            take(page_id)
            # The parent may have just become a leaf; if the scan passed it, it is the
            # oldest leaf now, so it goes next (else the scan reaches it in turn).
            parent = self._parent[page_id]
            while len(victims) < num_pages and parent is not None:
                parent_page = self._index.get(parent)
                if (
                    parent_page is None
                    or parent_page not in passed
                    or parent_page in taken
                    or parent_page in protected
                    or not is_leaf(parent_page)
                ):
                    break
                take(parent_page)
                parent = self._parent[parent_page]
        return victims

    # --- changes --------------------------------------------------------------------

    def evict(self, victims: Sequence[int]) -> None:
        """Forgets the cached pages `victims` (from `plan_store`); they become free."""
        for page_id in victims:
            if page_id not in self._lru and page_id not in self._kept:
                raise InvariantError(f"host page {page_id} evicted but not cached")
        hashes = [self._page_hash[p] for p in victims]
        lrus = [self._retention.lru(h) for h in hashes]
        unused = sum(not self._loaded[p] for p in victims)
        kept = sum(lru is self._kept for lru in lrus)
        entries = [(p, self._page_tokens[p], self._parent[p]) for p in victims]
        self.num_evicted_unused += unused
        self.num_evicted_retained += kept
        for page_id, page_hash, lru in zip(victims, hashes, lrus):
            self._forget(page_id, page_hash)  # type: ignore[arg-type]
            del lru[page_id]
            self._free.append(page_id)
        if self.undo is not None:
            self.undo.push(self._unevict, list(zip(hashes, entries)), unused, kept)
        if self.events is not None:
            for page_hash in hashes:
                self.events.removed(page_hash)  # type: ignore[arg-type]

    def _forget(self, page_id: int, page_hash: int) -> None:
        del self._index[page_hash]
        parent = self._parent[page_id]
        if parent is not None:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]
        self._page_hash[page_id] = self._page_tokens[page_id] = self._parent[page_id] = None

    def insert(
        self,
        page_ids: Sequence[int],
        page_hashes: Sequence[int],
        token_bytes: Sequence[bytes],
        parent_hashes: Sequence[int | None],
        keys: Sequence[EventKeys | None] | None = None,
    ) -> None:
        """Indexes free pages whose bytes were just written (the targets of a plan,
        after `evict` of its victims), at the young end of the LRU."""
        for page_id, page_hash in zip(page_ids, page_hashes, strict=True):
            if self._page_hash[page_id] is not None or page_hash in self._index:
                raise InvariantError(
                    f"host page {page_id} stored under {page_hash} while not free or the "
                    "hash is stored already"
                )
        if len(set(page_hashes)) != len(page_hashes):
            raise InvariantError(f"hashes {list(page_hashes)} stored twice in one call")
        loaded = [self._loaded[p] for p in page_ids]
        self._take_free(page_ids)
        for page_id, page_hash, data, parent in zip(
            page_ids, page_hashes, token_bytes, parent_hashes
        ):
            self._retention.lru(page_hash)[page_id] = None
            self._index[page_hash] = page_id
            self._page_hash[page_id] = page_hash
            self._page_tokens[page_id] = data
            self._parent[page_id] = parent
            self._loaded[page_id] = False
            if parent is not None:
                self._children[parent] = self._children.get(parent, 0) + 1
        if self.undo is not None:
            self.undo.push(self._uninsert, list(page_ids), loaded)
        if self.events is not None:
            page_keys = keys or [None] * len(page_ids)
            for page_hash, data, parent, page_key in zip(
                page_hashes, token_bytes, parent_hashes, page_keys
            ):
                self.events.stored(page_hash, parent, data, page_key)

    def _take_free(self, page_ids: Sequence[int]) -> None:
        """Removes `page_ids` (free pages that `plan_store` picked from the end of the
        stack, or victims appended there) from `_free`, looking only at its tail."""
        wanted, found, free = set(page_ids), 0, self._free
        i = len(free)
        while found < len(wanted):
            i -= 1
            if i < 0:
                raise InvariantError(f"host pages {sorted(wanted)} are not all free")
            found += free[i] in wanted
        free[i:] = [p for p in free[i:] if p not in wanted]

    def mark_loaded(self, page_ids: Iterable[int]) -> None:
        """The pages were loaded back into device pages (reused)."""
        page_ids = list(page_ids)
        if self.undo is not None:
            self.undo.push(self._unmark_loaded, [(p, self._loaded[p]) for p in page_ids])
        for page_id in page_ids:
            self._loaded[page_id] = True

    def touch(self, page_ids: Iterable[int]) -> None:
        """Moves cached (or kept) pages to the young end of their LRU, in the order given."""
        for page_id in page_ids:
            if page_id in self._lru:
                self._lru.move_to_end(page_id)
            elif page_id in self._kept:
                self._kept.move_to_end(page_id)

    def touch_hashes(self, page_hashes: Iterable[int]) -> None:
        """`touch` for the pages stored under these hashes (those that are stored)."""
        index = self._index
        self.touch(index[h] for h in page_hashes if h in index)

    def retain(self, page_hashes: Iterable[int]) -> None:
        """Retains these hashes (not retained yet): their pages, stored now or later, are
        kept (`Retention.retain`). Cannot fail half-way."""
        self._retention.retain(page_hashes, self._index, self.undo)

    def unretain(self, page_hashes: Iterable[int], old_end: bool = True) -> None:
        """Stops retaining these hashes: their kept pages become cached pages at the old
        end of the LRU, or the young end (`Retention.unretain`). Cannot fail half-way."""
        self._retention.unretain(page_hashes, self._index, old_end, self.undo)

    def reset_prefix_cache(self) -> None:
        """Forgets every hash and retention: every page becomes free (pinned pages keep
        their bytes; `plan_store` still refuses them until their loads are done)."""
        cached = itertools.chain(self._lru, self._kept)
        if self.undo is not None:
            self.undo.push(
                self._unreset,
                [(p, self._page_hash[p], self._page_tokens[p], self._parent[p]) for p in cached],
                list(self._lru),
                list(self._kept),
                set(self._retained),
                dict(self._children),
                len(self._free),
            )
        for page_id in itertools.chain(self._lru, self._kept):
            self._page_hash[page_id] = self._page_tokens[page_id] = self._parent[page_id] = None
            self._free.append(page_id)
        self._retention.clear()
        self._index.clear()
        self._children.clear()

    # --- checks ---------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raises InvariantError unless invariants 1-4 hold."""
        free, lru, kept = set(self._free), set(self._lru), set(self._kept)
        cached = lru | kept
        if (
            free & cached
            or lru & kept
            or len(free) + len(cached) != self.num_pages
            or len(free) != len(self._free)
        ):
            raise InvariantError(
                f"host pages: {len(free)} free, {len(lru)} cached and {len(kept)} kept of "
                f"{self.num_pages}, {len(free & cached) + len(lru & kept)} in two lists"
            )
        misfiled = self._retention.misfiled(self._page_hash)
        if misfiled:
            raise InvariantError(
                f"host pages {misfiled} are kept without a retained hash or cached with one"
            )
        children: dict[int, int] = {}
        for page_id in range(self.num_pages):
            h = self._page_hash[page_id]
            if (h is None) != (page_id in free):
                raise InvariantError(
                    f"host page {page_id} is {'free' if h is None else 'cached'}"
                    f" but sits in the other list"
                )
            if h is not None:
                if self._index.get(h) != page_id:
                    raise InvariantError(f"host page {page_id} has hash {h} but is not indexed")
                parent = self._parent[page_id]
                if parent is not None:
                    children[parent] = children.get(parent, 0) + 1
        if len(self._index) != len(cached):
            raise InvariantError(
                f"host index holds {len(self._index)} hashes for {len(cached)} cached pages"
            )
        if children != self._children:
            raise InvariantError("host child counts disagree with the stored parents")
