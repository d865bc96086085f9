"""Page-hash chains remembered across a request's calls, and what the device index
last answered for them.

A scheduler asks again and again about the same request: a prompt that does not fit is
tried at every step until pages free up (and released after each try), and a prompt
that fits is committed page by page over the steps that follow. vLLM hashes a prompt
once and keeps `request.block_hashes`; a mokv manager sees only contexts, so it keeps
each request's chain here, by request id, and reuses it while the request's tokens
are the same.

Safety does not rest on a hash. An entry is used only for the same request id, the same
`ChainKey` and the same parent hash, and only over pages whose token bytes are equal,
byte for byte, to the ones it was hashed from; the page hashes it gives back are then
the values the hash function would compute again. The memo is bounded: at most
`capacity` tokens over all entries, the least recently used entry dropped first.

What the index answered. Beside its chain an entry keeps the device hits last found for
a range of it (`Hits`) and the room the pool had with them taken (`Room`):
- a page found then is found again while it carries the same hash and tokens (with no
  index entry removed since, `PagePool.num_unindexed`, every one does); an index entry
  is only ever added for a hash the index lacks, so the hits are the first `n` found
  then, the `n` that still hold, if besides page `n` misses now (one lookup,
  `PrefixChains.device_hits`): a waiting prompt's cached pages are evicted one by one
  while it waits, and its run of hits is cut, never looked up again;
- with the same hits and no page freed since (`PagePool.num_freed`), the room with
  those hits taken cannot have grown, so a reservation that did not fit then still
  does not (`PrefixChains.room`);
- and the last refusal of a waiting prompt (`Refusal`, the refused plan itself): with
  the same hits list and the same window, the reservation wants the same fresh pages,
  so a retry reads only the hits and the room again and hands the same plan out
  (`PrefixChains.refused_again`); with its hits cut by evictions since, it counts the
  fresh pages again and plans no lookup.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from ...cache.extra_keys import HashInputs
from ...cache.hashing import TOKEN_BYTES
from ...cache.page_pool import PagePool
from ...context import RequestID
from .plans import Reservation

ChainKey = HashInputs | None
"""Everything besides the token ids and the parent hash that goes into a request's page
hashes (salt, adapter, images): `mokv.cache.extra_keys.hash_inputs` of its context."""

Page = tuple[int, bytes]
"""(page hash, the page's token bytes)."""


@dataclass(slots=True)
class Hits:
    """The device hits found for pages `[first, end)` of a chain: `hits`, the `(page id,
    hash)` of the run, which stopped at page `first + len(hits)` (a miss, when that is
    before `end`), and the same as two columns (`page_ids`, `hashes`: what
    `num_holding` compares); `tokens`, the hit pages' token bytes as the pool holds
    them; and the pool's `num_unindexed` when they were last known to hold.
    `positions` maps each hash to its place in the run, once an eviction needed it."""

    first: int
    end: int
    hits: list[tuple[int, int]]
    page_ids: list[int]
    hashes: list[int]
    tokens: list[bytes | None]
    unindexed: int
    positions: dict[int, int] | None = None

    def num_holding(self, pool: PagePool) -> int:
        """How many leading hits are still indexed as found (all of them while no index
        entry was removed since); remembers the reading when all are.

        A page loses its hash (and its tokens) only when its index entry is removed, so
        the hits that hold are the ones before the first whose hash the pool unindexed
        since (`PagePool.unindexed_since`: a few per step, where reading every hit
        costs a pass over a long prompt's run); or, when the pool no longer knows
        those hashes, the ones that still carry their hash and tokens."""
        n = len(self.hits)
        if not n or self.unindexed == pool.num_unindexed:  # none to lose (most waiting prompts)
            return n
        removed = pool.unindexed_since(self.unindexed)
        if removed is None:
            n = pool.num_still_indexed(self.page_ids, self.hashes, self.tokens)
        elif removed:
            if self.positions is None:
                # the first place of each hash (a chain may repeat one, however unlikely)
                self.positions = dict(zip(reversed(self.hashes), range(n - 1, -1, -1)))
            n = min(n, *map(self.positions.get, removed, repeat(n)))
        if n == len(self.hits):
            self.unindexed = pool.num_unindexed
        return n

    def truncated(self, n: int, pool: PagePool) -> Hits:
        """These hits cut to the first `n` (which still hold), read at `pool`'s counter."""
        return Hits(
            self.first,
            self.end,
            self.hits[:n],
            self.page_ids[:n],
            self.hashes[:n],
            self.tokens[:n],
            pool.num_unindexed,
            self.positions,  # places past `n` are never read: `num_holding` takes the least
        )


@dataclass(slots=True)
class Room:
    """`PagePool.room` of `hits` (the same list object as `Hits.hits`), read when the
    pool had freed `freed` pages (`PagePool.num_freed`)."""

    hits: Sequence[tuple[int, int]]
    freed: int
    room: int


@dataclass(slots=True)
class Refusal:
    """The refused `plan` of the request (its hits the same list object as `Hits.hits`)
    for the context's `window` (its start, active and end indices and the steps asked)
    on a request holding no page."""

    plan: Reservation
    window: tuple[int, int, int, int]


@dataclass(slots=True)
class ChainEntry:
    """The chain of pages `[0, len(pages))` of one request's tokens: page 0 chains from
    `root`, page `i` from `pages[i - 1]`'s hash; `data` is their token bytes joined."""

    key: ChainKey
    root: int
    data: bytes
    pages: list[Page]
    hits: Hits | None = None
    room: Room | None = None
    refusal: Refusal | None = None

    def matching_pages(
        self, key: ChainKey, parent: int, tokens: np.ndarray, page_size: int, first: int, end: int
    ) -> int:
        """How many of pages `[first, end)` of `tokens`, chained from `parent`, this entry
        holds (0 unless the key and parent match and every token byte of those pages
        is equal)."""
        n = min(end, len(self.pages))
        if n <= first or key != self.key:
            return 0
        if parent != (self.pages[first - 1][0] if first else self.root):
            return 0
        want = tokens[first * page_size : n * page_size]
        # Compared through the array's buffer: a copy of a long prompt's bytes cost as
        # much as the comparison. Only the buffer of a contiguous int64 array holds the
        # bytes the entry was made of (numpy refuses a strided one's: ValueError).
        if want.dtype is not TOKEN_BYTES:
            want = np.ascontiguousarray(want, dtype=TOKEN_BYTES)
        offset = first * page_size * 8
        try:
            same = self.data.startswith(want, offset)  # type: ignore[arg-type]
        except (ValueError, BufferError):
            same = self.data.startswith(np.ascontiguousarray(want), offset)  # type: ignore[arg-type]
        return n - first if same else 0


class ChainMemo:
    """The chains of the most recently used requests (see the module docstring), at most
    `capacity` tokens over all of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[RequestID, ChainEntry] = OrderedDict()
        self._tokens = 0  # page tokens held over all entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, request_id: RequestID) -> ChainEntry | None:
        """The request's entry (not checked against its tokens: see `matching_pages`)."""
        entry = self._entries.get(request_id)
        if entry is not None:
            self._entries.move_to_end(request_id)
        return entry

    def put(self, request_id: RequestID, entry: ChainEntry) -> None:
        """Remembers `entry` as the request's chain, dropping the least recently used
        entries beyond `capacity` tokens (an entry larger than that is not kept)."""
        self.forget(request_id)
        size = _num_tokens(entry)
        if size > self.capacity:
            return
        while self._tokens + size > self.capacity:
            _, old = self._entries.popitem(last=False)
            self._tokens -= _num_tokens(old)
        self._entries[request_id] = entry
        self._tokens += size

    def forget(self, request_id: RequestID) -> None:
        """Drops the request's entry, if any."""
        old = self._entries.pop(request_id, None)
        if old is not None:
            self._tokens -= _num_tokens(old)

    @property
    def num_tokens(self) -> int:
        """Page tokens held over all entries."""
        return self._tokens


def _num_tokens(entry: ChainEntry) -> int:
    return len(entry.data) // 8  # int64 token ids
