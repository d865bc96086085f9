"""Errors raised by mokv.

Three kinds of failure, never a sentinel value:
- "does not fit now" is not an error: `maybe_reserve` returns False and changes nothing;
- a caller's mistake raises one of the `ValueError`/`KeyError` subclasses below, naming
  the bad value, and leaves the manager unchanged;
- a broken internal state raises `InvariantError` (only checked when asked for).
"""

from __future__ import annotations


class MokvError(Exception):
    """Base class of every error mokv raises on purpose."""


class UnknownRequestError(MokvError, KeyError):
    """A request id that the manager does not track."""

    def __init__(self, request_id: object) -> None:
        super().__init__(f"request {request_id!r} is not claimed by this KV cache manager")
        self.request_id = request_id

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0])


class AlreadyClaimedError(MokvError, ValueError):
    """A request id claimed a second time."""

    def __init__(self, request_id: object) -> None:
        super().__init__(f"request {request_id!r} is already claimed")
        self.request_id = request_id


class SequenceTooLongError(MokvError, ValueError):
    """A sequence that would grow past `max_seq_len`."""


class BatchTooLargeError(MokvError, ValueError):
    """More requests than `max_batch_size` (per replica) at once."""


class InvalidReplicaError(MokvError, ValueError):
    """A data-parallel replica index out of range."""


class StaleContextError(MokvError, ValueError):
    """A context whose cache window disagrees with what the manager holds for it, e.g.
    `ctx.reset()` without releasing the request: writing there would overwrite pages
    that other requests may share."""


class InsufficientPagesError(MokvError, RuntimeError):
    """`fetch` needed pages that the pool does not have (call `maybe_reserve` first)."""


class InsufficientMemoryError(MokvError, ValueError):
    """The memory budget cannot hold what the configuration asks for."""


class InvariantError(MokvError, AssertionError):
    """The allocator's bookkeeping is inconsistent: a bug in mokv, never the caller's fault."""
