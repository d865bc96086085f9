"""The argument checks of MAX's sequence-id flow, shared by the Python manager
(`ContinuousBatchingKVCacheManager`, sequences.py) and the Mojo one's Python front end
(`MojoContinuousBatchingKVCacheManager`, mojo_continuous.py): one source of the errors
and their messages, so that both refuse the same inputs alike.

A sequence id is the int index of its slot and a token count an int >= 0: an `int`
exactly, not a bool, not a float holding an integer. Every call checks, in this order,
what its arguments are (`check_*`: no state needed, so the Mojo front end checks them
in Python before anything reaches the extension, whose ints are 64-bit), then what
they name: each id claimed, in order, then the lengths. The Python manager checks the
second part from its dict; the Mojo table checks it under its lock, and its errors are
rebuilt with the messages here (`UnknownRequestError`, `too_long`, `too_few_slots`).

    TypeError              an id or a count of another type; `step` without a mapping
    UnknownRequestError    an id out of the slots' range, or not claimed
    ValueError             a count < 0, a repeated id, claim(n) with n < 1
    BatchTooLargeError     more ids or sequences than the slots
    SequenceTooLongError   lengths or steps past `max_seq_len`
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import BatchTooLargeError, SequenceTooLongError, UnknownRequestError
from .base import check_num_steps


def is_count(value: object) -> bool:
    """An int (a sequence id, a number of sequences or of tokens); bool excluded. These
    checks run on every call of every sequence: `__class__ is int` is the cheap test."""
    return value.__class__ is int


def check_claim(n: object) -> int:
    """`n` of `claim(n)`: a positive int (`too_few_slots` past the free slots)."""
    if n.__class__ is not int or n < 1:
        raise ValueError(f"claim(n) needs a positive number of sequences, got {n!r}")
    return n


def too_few_slots(what: str, num_free: int, num_slots: int) -> BatchTooLargeError:
    """The error of a claim that the free slots cannot hold."""
    return BatchTooLargeError(f"cannot claim {what}: {num_free} of {num_slots} slots are free")


def check_ids(seq_ids: Sequence[object], num_slots: int) -> None:
    """Each id, in order: TypeError for a non-int, `UnknownRequestError` (a `ValueError`,
    as in MAX) for one out of the slots' range (never claimed)."""
    for seq_id in seq_ids:
        if seq_id.__class__ is not int:
            raise TypeError(f"sequence ids are ints, got {type(seq_id).__name__} {seq_id!r}")
        if not 0 <= seq_id < num_slots:
            raise UnknownRequestError(seq_id)


def check_fetch(seq_ids: Sequence[int], num_steps: int, num_slots: int) -> list[int]:
    """The ids of `fetch(seq_ids, num_steps)`: `num_steps`, the batch size, each id, no
    id twice (then the caller checks each is claimed, then `check_room`)."""
    check_num_steps(num_steps)
    ids = list(seq_ids)
    if len(ids) > num_slots:
        raise BatchTooLargeError(
            f"batch of {len(ids)} is larger than max_cache_batch_size={num_slots}"
        )
    check_ids(ids, num_slots)
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        twice = next(s for s in ids if s in seen or seen.add(s))  # type: ignore[func-returns-value]
        raise ValueError(f"sequence id {twice} appears twice in the batch {ids}")
    return ids


def check_room(
    seq_ids: Sequence[int], lengths: Sequence[int], num_steps: int, max_seq_len: int
) -> None:
    """SequenceTooLongError unless each sequence, holding `lengths`, has room for
    `num_steps` more tokens (a step writes at least one)."""
    for seq_id, length in zip(seq_ids, lengths):
        if length + num_steps > max_seq_len:
            raise SequenceTooLongError(
                f"sequence {seq_id} holds {length} tokens: {num_steps} more step(s) would "
                f"pass max_seq_len={max_seq_len}"
            )


def check_step(new_tokens: object, num_slots: int) -> Mapping[int, int]:
    """`new_tokens` of `step(new_tokens)`: a mapping, each id, each count (then the
    caller checks each id is claimed, then the lengths with `too_long`)."""
    if not isinstance(new_tokens, Mapping):
        raise TypeError(
            f"step takes a mapping {{seq_id: new_tokens}}, got {type(new_tokens).__name__} "
            f"{new_tokens!r}"
        )
    check_ids(list(new_tokens), num_slots)
    for seq_id, n in new_tokens.items():
        if n.__class__ is not int or n < 0:
            raise ValueError(f"sequence {seq_id} wrote {n!r} tokens; a token count is an int >= 0")
    return new_tokens


def too_long(seq_id: int, length: int, new_tokens: int, max_seq_len: int) -> SequenceTooLongError:
    """The error of a step that would grow a sequence holding `length` tokens by
    `new_tokens` past `max_seq_len` (it names the count given, not only the sum)."""
    return SequenceTooLongError(
        f"sequence {seq_id} holds {length} tokens: {new_tokens} new tokens would pass "
        f"max_seq_len={max_seq_len}"
    )
