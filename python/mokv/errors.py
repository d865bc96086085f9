"""Errors raised by mokv.

Three kinds of failure, never a sentinel value:
- "does not fit now" is not an error: `maybe_reserve` returns False and changes nothing;
- a caller's mistake raises one of the `ValueError`/`KeyError` subclasses below, naming
  the bad value, and leaves the manager unchanged;
- a broken internal state raises `InvariantError` (only checked when asked for).

Each class is also an instance of every built-in error that MAX's reference managers
(MAX 25.7's `max.kv_cache`, seeds 000-003) raise for the same condition, so that
`except ValueError:` code ported from MAX still catches it:

    error                   MAX 25.7 raises                         built-ins here
    UnknownRequestError     KeyError (paged), ValueError (per-replica   KeyError, ValueError
                            manager, the sequence-id flow)
    AlreadyClaimedError     ValueError                              ValueError
    BatchTooLargeError      ValueError ("No available sequence IDs") ValueError
    SequenceTooLongError    RuntimeError (fetch past max_seq_len)   ValueError, RuntimeError
    InvalidReplicaError     IndexError (a list index)               ValueError, IndexError
    InsufficientPagesError  InsufficientBlocksError (an Exception)  RuntimeError
    InsufficientMemoryError RuntimeError (not even one page)        ValueError, RuntimeError
"""

from __future__ import annotations


class MokvError(Exception):
    """Base class of every error mokv raises on purpose."""


class UnknownRequestError(MokvError, KeyError, ValueError):
    """A request (or sequence) id that the manager does not track."""

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


class SequenceTooLongError(MokvError, ValueError, RuntimeError):
    """A sequence that would grow past `max_seq_len`."""


class BatchTooLargeError(MokvError, ValueError):
    """More requests than `max_batch_size` (per replica) at once."""


class InvalidReplicaError(MokvError, ValueError, IndexError):
    """A data-parallel replica index out of range."""


class StaleContextError(MokvError, ValueError):
    """A context whose cache window disagrees with what the manager holds for it, e.g.
    `ctx.reset()` without releasing the request: writing there would overwrite pages
    that other requests may share."""


class InsufficientPagesError(MokvError, RuntimeError):
    """`fetch` needed pages that the pool does not have (call `maybe_reserve` first)."""


class InsufficientMemoryError(MokvError, ValueError, RuntimeError):
    """The memory budget cannot hold what the configuration asks for."""


class InvariantError(MokvError, AssertionError):
    """The allocator's bookkeeping is inconsistent: a bug in mokv, never the caller's fault."""
