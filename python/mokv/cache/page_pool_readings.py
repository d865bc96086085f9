"""What a memo of a `PagePool`'s answers reads to tell whether they still hold (the prefix
memo, `mokv.managers.paged.chain_memo`): runs of lookups, the pages' token bytes, and
which index entries were removed since a reading of `num_unindexed`.

A page loses its hash (and its token bytes) only when its index entry is removed: by an
eviction (`take`), an undone `commit_pages` or a reset. Each of the first two counts
the entries in `num_unindexed` and logs their hashes (`_count_unindexed`); a reset
counts them and clears the log, which then no longer covers the readings before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

UNINDEXED_LOG = 4096
"""Most hashes of removed index entries the pool remembers (`unindexed_since`); a memo
that last looked longer ago reads its hits again."""


class PagePoolReadings:
    """The readings half of `PagePool` (its base class: these read the pool's fields)."""

    num_unindexed: int
    _page_hash: list[int | None]
    _page_tokens: list[bytes | None]
    _index: dict[int, int]
    _unindexed: list[int]

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

    def _count_unindexed(self, page_hashes: list[int]) -> None:
        """Counts index entries just removed (`num_unindexed`) and logs their hashes."""
        self.num_unindexed += len(page_hashes)
        log = self._unindexed
        log += page_hashes
        if len(log) > UNINDEXED_LOG:
            del log[: len(log) - UNINDEXED_LOG // 2]

    def unindexed_since(self, reading: int) -> list[int] | None:
        """The hashes of the index entries removed since `num_unindexed` was `reading`
        (a hash may appear more than once), or None when they are no longer all logged
        (too many since, or a reset)."""
        count, log = self.num_unindexed - reading, self._unindexed
        return log[len(log) - count :] if count <= len(log) else None
