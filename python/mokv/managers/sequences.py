"""MAX's sequence-id flow of the continuous-batching cache, over the manager's slots.

    seq_ids = manager.claim(2)              # new sequence ids, each bound to a free slot
    manager.step({seq_ids[0]: 12})          # context encoding wrote 12 tokens
    inputs = manager.fetch(seq_ids)         # cache_lengths come from the counts above
    manager.step({seq_ids[0]: 1, seq_ids[1]: 1})
    manager.release(seq_ids[0])

Here the manager counts the cache lengths itself (the request flow reads them from
each context). A sequence id is the int index of its slot; request ids are strings, so
the two flows share the slots but never each other's ids. Every call checks all of its
arguments before it changes anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import BatchTooLargeError, SequenceTooLongError, UnknownRequestError
from .base import check_num_steps

if TYPE_CHECKING:
    from .continuous import ContinuousBatchingKVCacheManager


def is_sequence_id(value: object) -> bool:
    """True for an int sequence id (bool excluded), False for anything else."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_sequence_id_batch(batch: Sequence[Any]) -> bool:
    """True for a batch of sequence ids, False for one of contexts (or an empty batch);
    TypeError for a mix of the two."""
    kinds = {is_sequence_id(x) for x in batch}
    if len(kinds) > 1:
        raise TypeError("a batch holds either sequence ids (ints) or request contexts, not both")
    return kinds == {True}


class SequenceIdFlow:
    """Sequence ids over a continuous manager's slots, with cache lengths counted here."""

    def __init__(self, manager: ContinuousBatchingKVCacheManager) -> None:
        self._manager = manager
        self._lengths: dict[int, int] = {}  # seq_id (= slot) -> tokens in its cache

    def claim(self, n: int) -> list[int]:
        """`n` new sequence ids bound to free slots (lowest first), each with length 0."""
        if not is_sequence_id(n) or n < 1:
            raise ValueError(f"claim(n) needs a positive number of sequences, got {n!r}")
        seq_ids = self._manager._take_slots(n, f"{n} sequences")
        self._lengths.update((s, 0) for s in seq_ids)
        return seq_ids

    def contains(self, seq_id: int) -> bool:
        return seq_id in self._lengths

    def _check(self, seq_id: object) -> int:
        if not is_sequence_id(seq_id):
            raise TypeError(f"sequence ids are ints, got {type(seq_id).__name__} {seq_id!r}")
        if seq_id not in self._lengths:
            raise UnknownRequestError(seq_id)
        return seq_id  # type: ignore[return-value]

    def cache_length(self, seq_id: int) -> int:
        """Tokens in the sequence's cache."""
        return self._lengths[self._check(seq_id)]

    def release(self, seq_id: int) -> None:
        """Frees the sequence's slot."""
        self._check(seq_id)
        del self._lengths[seq_id]
        self._manager._free_slots.append(seq_id)

    def fetch(self, seq_ids: Sequence[int], num_steps: int = 1) -> list[Any]:
        """One `ContinuousBatchingKVCacheInputs` per device for these sequences."""
        check_num_steps(num_steps)
        manager = self._manager
        if len(seq_ids) > manager.max_cache_batch_size:
            raise BatchTooLargeError(
                f"batch of {len(seq_ids)} is larger than "
                f"max_cache_batch_size={manager.max_cache_batch_size}"
            )
        slots = [self._check(s) for s in seq_ids]
        if len(set(slots)) != len(slots):
            raise ValueError(f"a sequence id appears twice in the batch {list(seq_ids)}")
        return manager._inputs(slots, [self._lengths[s] for s in slots])

    def step(self, new_tokens: Mapping[int, int]) -> None:
        """Adds each sequence's newly written token count to its cache length (checks
        every id, then every count, then every length, as the Mojo manager does)."""
        for seq_id in new_tokens:
            self._check(seq_id)
        for seq_id, n in new_tokens.items():
            if not is_sequence_id(n) or n < 0:
                raise ValueError(
                    f"sequence {seq_id} wrote {n!r} tokens; a token count is an int >= 0"
                )
        grown = {}
        for seq_id, n in new_tokens.items():
            grown[seq_id] = self._lengths[seq_id] + n
            if grown[seq_id] > self._manager.max_seq_len:
                raise SequenceTooLongError(
                    f"sequence {seq_id} would hold {grown[seq_id]} tokens, past "
                    f"max_seq_len={self._manager.max_seq_len}"
                )
        self._lengths.update(grown)
