"""UndoLog: how to undo what a manager call changed, so that an exception raised from
anywhere inside the call (a `KeyboardInterrupt`, a `MemoryError`, a failing callback)
leaves the state as it was before the call.

Every object a manager call changes (page pools, a replica's requests, the tiers, the
event recorders) holds the manager's log in its `undo` attribute. Each of its changing
methods records there how to undo its change: a function and its arguments, pushed
*inside* the method, so that an exception raised right after the method returned finds
the record already there. A record pushed before the change it undoes must be
idempotent (truncate a list to its old length, restore an old value); one pushed after
the change may assume it happened.

The manager runs each public call's changes as `undo.run(fn, *args)`:

    mark = undo.begin()
    try:
        return fn(*args)         # inner calls push their records
    except BaseException:
        undo.rollback(mark)      # runs the records pushed since `mark`, newest first
        raise
    finally:
        undo.end()

`commit()` drops every record: after it nothing done so far can be undone (a manager
commits a reservation once a context moved its window: a context cannot be moved back).
Calls nest (a re-entrant lock lets a public call make another); only the outermost
`end` forgets the records, and `begin` at the outermost level drops records left by
calls made outside any bracket (tests that drive a pool directly).

Rolling back runs plain list and dict operations; a second exception raised *during* a
rollback is not covered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

R = TypeVar("R")


class UndoLog:
    """Undo records, oldest first."""

    __slots__ = ("_steps", "_depth")

    def __init__(self) -> None:
        self._steps: list[tuple[Callable[..., Any], tuple]] = []
        self._depth = 0

    def __len__(self) -> int:
        return len(self._steps)

    def run(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """`fn(*args, **kwargs)`, all or nothing: on any exception, what it recorded is
        undone."""
        # `begin` and `end`, inlined: this brackets every changing call of a manager.
        steps = self._steps
        if not self._depth:
            steps.clear()
        self._depth += 1
        mark = len(steps)
        try:
            return fn(*args, **kwargs)
        except BaseException:
            self.rollback(mark)
            raise
        finally:
            self._depth -= 1
            if not self._depth:
                self._steps.clear()

    def push(self, undo: Callable[..., Any], *args: Any) -> None:
        """Records that `undo(*args)` undoes the change just made (or about to be made)."""
        self._steps.append((undo, args))

    def begin(self) -> int:
        """Opens a (possibly nested) bracket; returns its mark for `rollback`."""
        if not self._depth:
            self._steps.clear()
        self._depth += 1
        return len(self._steps)

    def end(self) -> None:
        """Closes a bracket; the outermost one forgets every record."""
        self._depth -= 1
        if not self._depth:
            self._steps.clear()

    def rollback(self, mark: int = 0) -> None:
        """Undoes every record pushed since `mark` (from `begin`), newest first. What
        an undo function records itself is dropped (it is part of the rollback)."""
        steps, self._steps = self._steps, []
        try:
            while len(steps) > mark:
                undo, args = steps.pop()
                undo(*args)
        finally:
            self._steps = steps

    def commit(self) -> None:
        """Forgets every record: what was done so far stands, whatever happens next."""
        self._steps.clear()


def values_of(owner: Any, names: Sequence[str]) -> tuple[Any, ...]:
    """The values of `owner`'s attributes `names` (a record's old values: `set_values`)."""
    return tuple(getattr(owner, name) for name in names)


def set_values(owner: Any, names: Sequence[str], values: Sequence[Any]) -> None:
    """Sets `owner`'s attributes `names` to `values` (from `values_of`)."""
    for name, value in zip(names, values):
        setattr(owner, name, value)
