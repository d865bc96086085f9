"""SlidingWindowGroup: layers whose query reads only the `window_size` tokens ending at
itself (Gemma 3's local layers, GPT-OSS's and Olmo 3's sliding ones).

A step whose cache ends at `start_idx` writes its tokens from there, and its first
query, at `start_idx`, reads back to `start_idx - window_size + 1`: every page before
`window_start(start_idx) = max(0, start_idx - window_size + 1) // page_size` is read by
no later step of the request. So the group holds only a request's pages from there on
(`RequestState.firsts`), drawn for page size 4 and a window of 6:

    page index:    0    1    2    3    4
    full group:   [p3 ][p8 ][p1 ][p6 ][p2 ]    every page, until the release
    this group:   [pad][pad][p5 ][p0 ][p4 ]    from window_start(17) = 12 // 4 = 3 on,
                              ^ released        once page 2 is read by no step either
                                                (start_idx = 17: tokens 12..16 are read)

A request's pages here are bounded by its window plus the tokens of one step, not by
its length. The pages that leave the window are released (`slide`, at `step` and when a
prefix hit moves the window): a committed page becomes a cached page of the pool (found
by a later prefix hit); an uncommitted one is free. Of the committed ones, a later
joint hit can read only those in the window before where it ends, so `slide` keeps the
window before each of `keep_ends` (the end of the request's last joint hit, and of the
prefix it shares with other requests: `JointGroups.keep_ends`) at the young end of the
LRU and puts the others at its old end, evicted before any page released the usual way.

Prefix hits. A hit of `n` pages needs, here, only the pages the query after it reads:
the `pages_in_window = ceil((window_size - 1) / page_size)` pages before page `n` (all
`n` pages when there are fewer). So the group's longest hit is a *suffix* run that ends
the prefix, and which suffix depends on where the prefix ends: shortening a hit for
another group can break this group's run, which is why the joint hit iterates
(`joint.py`). The rule is MAX 26.7's (`KVCacheGroupId.longest_hit`, whose docstring
draws it); mokv's tests check it against MAX's own `max._kv_core.LeafShape`.

Where mokv differs from MAX 26.7 on purpose:
- the window's first page is `window_start(start_idx)` exactly: MAX frees the pages
  below `processed_length // page_size - pages_in_window`, which keeps up to one page
  more than any step reads whenever `start_idx` is not on a page boundary;
- a released request hands its pages back head first (MAX and vLLM: tail first, as for
  a full group): the pages a later hit here needs are the window before its end, and
  the next turn of a conversation continues from the end, so the tail is evicted last;
- the pages a slide releases outside the windows a later joint hit reads go to the old
  end of the LRU (MAX and vLLM: the young end, tail first), so they are evicted before
  a shared prefix's last window (`docs/benchmarks.md`: 0.381 against 0.397 of prompt
  tokens hit on the Gemma-3-like trace).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from ..plans import RequestState
from .full import FullAttentionGroup


class SlidingWindowGroup(FullAttentionGroup):
    """A `FullAttentionGroup` whose layers read the last `window_size` tokens: the same
    pool, buffers and commits; `first(req)` moves up as the request's window does."""

    kind: ClassVar[str] = "sliding_window"

    def __init__(self, *args: Any, window_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window_size = window_size
        self.lookback = window_size - 1
        """Tokens before a query that it reads."""
        self.pages_in_window = -(-self.lookback // self.page_size)

    def window_start(self, start_idx: int) -> int:
        """The first page that a step whose cache ends at `start_idx` reads."""
        return max(0, start_idx - self.lookback) // self.page_size

    def longest_hit(self, pages: list[int | None], n: int) -> int:
        """The longest hit of at most `n` pages whose window is found (`window_hit`)."""
        return window_hit(pages, n, self.pages_in_window)

    def held_of_hit(self, n: int) -> int:
        """The pages of a hit of `n` the window after it reads: its last
        `pages_in_window`."""
        return min(n, self.pages_in_window)

    def slide(self, req: RequestState, start_idx: int, keep_ends: Sequence[int] = ()) -> None:
        """Releases the request's pages before `window_start(start_idx)` and pads their
        page-table entries. The pages in the window before one of `keep_ends` (where a
        later joint hit may end: `JointGroups.keep_ends`) join the pool's LRU as usual,
        head first; the others, which only a hit ending inside the request's own tokens
        could read, join its old end, tail first (evicted before any other page)."""
        first, new_first = req.firsts[self.index], self.window_start(start_idx)
        if new_first <= first:
            return
        self.undo.push(self.unslide, req, first)  # idempotent: before the changes
        row, w = self.row(req), self.pages_in_window
        keep = {i for end in keep_ends for i in range(max(first, end - w), min(end, new_first))}
        cold = [row[i] for i in range(new_first - 1, first - 1, -1) if i not in keep]
        self.pool.release_cold(cold)
        self.pool.release([row[i] for i in sorted(keep)])
        req.firsts[self.index] = new_first
        self.page_table.pad(req.slot, first, new_first)

    def unslide(self, req: RequestState, first: int) -> None:
        """The undo of `slide`: the request holds its pages from `first` again (the pool
        restores their owners)."""
        req.firsts[self.index] = first
        self.write_row(req)

    def release(self, req: RequestState) -> None:
        """Hands back every page the request holds here, head first."""
        self.pool.release(self.held(req))


def window_hit(pages: Sequence[int | None], n: int, pages_in_window: int) -> int:
    """A sliding-window group's longest hit of at most `n` of `pages` (found, or None):
    the longest prefix whose last `pages_in_window` pages (all, when fewer) are found,
    the request's own pages before `pages` counting as found. From `n` down, each
    candidate ending within a window of a missing page is passed over to that page
    (every candidate between them reads it), so each page is read once."""
    m = min(n, len(pages))
    while m > 0:
        for i in range(m - 1, max(0, m - pages_in_window) - 1, -1):
            if pages[i] is None:
                m = i
                break
        else:
            return m
    return 0
