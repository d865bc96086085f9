"""UnindexedLog: how many index entries a page pool removed, and the hashes of the last
ones, so that a memo of the pool's answers can tell whether they still hold (the prefix
memo, `mokv.managers.paged.chain_memo`).

A page loses its hash (and its token bytes) only when its index entry is removed: by an
eviction (`PagePool.take`), an undone `commit_pages` or a reset. The first two `note`
the entries' hashes; a reset counts them and `clear`s the log, which then no longer
covers the readings before it.
"""

from __future__ import annotations

UNINDEXED_LOG = 4096
"""Most hashes of removed index entries remembered (`since`); a memo that last looked
longer ago reads its hits again."""


class UnindexedLog:
    """`count` (removed index entries, ever; only grows) and the last removed hashes."""

    __slots__ = ("count", "_hashes")

    def __init__(self) -> None:
        self.count = 0
        self._hashes: list[int] = []  # the last removed entries' hashes, oldest first

    def note(self, page_hashes: list[int]) -> None:
        """Counts index entries just removed and logs their hashes."""
        self.count += len(page_hashes)
        log = self._hashes
        log += page_hashes
        if len(log) > UNINDEXED_LOG:
            del log[: len(log) - UNINDEXED_LOG // 2]

    def clear(self, num_removed: int) -> None:
        """Counts `num_removed` entries removed at once (a reset), too many to log: `since`
        answers None for every earlier reading."""
        self.count += num_removed
        self._hashes.clear()

    def since(self, reading: int) -> list[int] | None:
        """The hashes of the entries removed since `count` was `reading` (a hash may
        appear more than once), or None when they are no longer all logged (too many
        since, or a reset)."""
        count, log = self.count - reading, self._hashes
        return log[len(log) - count :] if count <= len(log) else None
