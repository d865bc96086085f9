"""HostCheckpoints: the recurrent state's checkpoints in the host tier (`HostTierConfig`
beside `KVCacheParams.recurrent`).

A checkpoint evicted from its device slot (`RecurrentStateGroup.slide`, when a new one
needs the slot) is kept here, a host copy of its whole state (every region and device),
under the chain hash and tokens of its boundary page, as the host tier keeps attention
pages. The joint prefix hit finds a checkpoint on the device or here
(`RecurrentStateGroup.found`), so a hit whose attention pages come from the tiers
resumes from the state the host kept, copied back bit for bit into the request's live
block; the hit never passes the checkpoint, wherever it stands.

Room: the host tier's memory is split between the attention groups and the state in
proportion to what each keeps per page of prefix (`group_tiers.host_shares`: a state of
`bytes_per_state` per `checkpoint_every` pages), so a host tier keeps as many pages'
worth of checkpoints as of each group's pages. Least recently used first out; a resume
from here touches its checkpoint.

All or nothing: each change records its undo; the copies kept here are never written
after they are made (a rollback of the device copy reads the same host copy).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from max.driver import Buffer

from ....errors import InvariantError
from ....undo import UndoLog


class StoredCheckpoint(NamedTuple):
    """A checkpoint in host memory (the host tier's, or loaded from the shared tier):
    its boundary page's hash and its state."""

    page_hash: int
    copies: list[list[Buffer]]
    """The state, region then device (`RecurrentStateGroup._host_copy`)."""
    shared: bool = False
    """Loaded from the shared tier (`state_shared.py`), not kept by this one."""


class HostCheckpoints:
    """One replica's checkpoints in host memory, at most `capacity` of them."""

    def __init__(self, capacity: int, undo: UndoLog) -> None:
        self.capacity = capacity
        self.undo = undo
        self._lru: OrderedDict[int, tuple[bytes, list[list[Buffer]]]] = OrderedDict()
        """Each kept checkpoint's token bytes and state, by boundary hash, oldest first."""
        self.num_stored = 0
        """Checkpoints stored since the tier was built."""

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, page_hash: int, token_bytes: bytes) -> StoredCheckpoint | None:
        """The checkpoint kept at this boundary (tokens compared), or None. Pure."""
        kept = self._lru.get(page_hash)
        if kept is None or kept[0] != token_bytes:
            return None
        return StoredCheckpoint(page_hash, kept[1])

    def store(self, page_hash: int, token_bytes: bytes, copies: list[list[Buffer]]) -> None:
        """Keeps `copies` (never written afterwards) at this boundary, the oldest
        checkpoint giving its room when the tier is full; one already kept there stays."""
        if not self.capacity or page_hash in self._lru:
            return
        self._save_order()
        if len(self._lru) >= self.capacity:
            self._lru.popitem(last=False)
        self._lru[page_hash] = (token_bytes, copies)
        self.undo.push(setattr, self, "num_stored", self.num_stored)
        self.num_stored += 1

    def touch(self, page_hash: int) -> None:
        """A resume read this checkpoint: it is the last one out."""
        self._save_order()
        self._lru.move_to_end(page_hash)

    def reset(self) -> None:
        """Forgets every checkpoint (`reset_prefix_cache`)."""
        self._save_order()
        self._lru.clear()

    def _save_order(self) -> None:
        # The whole index, undone as one: a change here comes with a copy of a whole
        # state (far more bytes), and an OrderedDict's order has no cheaper undo.
        self.undo.push(self._restore_order, list(self._lru.items()))

    def _restore_order(self, items: list[tuple[int, tuple[bytes, list[list[Buffer]]]]]) -> None:
        self._lru = OrderedDict(items)

    def check_invariants(self) -> None:
        """InvariantError when the tier holds more checkpoints than its room."""
        if len(self._lru) > self.capacity:
            raise InvariantError(
                f"host checkpoints: {len(self._lru)} kept, room for {self.capacity}"
            )
