"""The tier protocol: what a paged replica asks of each cache tier below its device pages.

A replica finds a request's prefix in its device pages first, then asks each tier of
`params.tiers`, in that order, to continue the same hash chain (host.py: host memory;
remote.py: a Redis server that several servers share). A tier hit needs a fresh device
page, as a miss does, and becomes a pending load that `fetch` copies in before the
graph runs. The calls a tier gets, by manager call (the core, `Tier`, and in brackets
the optional capabilities a tier may add, each its own Protocol below):

    maybe_reserve / fetch   lookup(chain) -> hits      pure, but for the tier's counters
                            [pin(hits)]                the hits stay loadable until unpin
                            [note_reserved(...)]       what the device pool handed out
    fetch                   load(hits, device_pages)   then [unpin(hits)]
    release                 [unpin(hits)]              a reservation dropped unloaded
    step                    store(pages)               pages newly committed on the device
    reset_prefix_cache      reset()
    close                   close()
    metrics                 metrics(), reset_metrics()
    sessions                [retain(hashes), unretain(hashes, old_end)]
    pins                    [pin_prefixes(hashes), unpin_prefixes(hashes),
                             holds_pinned(hash)]
    events                  [publish_to(recorder)]
    enable_runtime_checks   [check_invariants(pinned)]
    undo                    [undo: the manager's log]

MAX 26.7's `KVConnector` is the model of the narrow core (lookup, load, offload, touch,
poll, shutdown); mokv differs on purpose in making the reservation's side (pins,
notices) a capability rather than a stub every tier must write, so that a tier that
evicts nothing (the shared tier) implements nothing for it.

Adding a tier (a local disk, a peer server) is a `TierConfig` subclass (`mokv.config.tiers`:
a frozen dataclass whose `__post_init__` checks its fields) and a module with a class
that meets `Tier` and registers its builder for the config (`mokv.registry.BUILDERS`:
`builder(config, params, num_layers, pool, blocks, scales, group_key)`, `group_key` naming the
cache group in a cache of several, else None).
Users list the config in `KVCacheParams.tiers`; nothing else names the tier.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..cache.extra_keys import EventKeys
    from ..events.publisher import TierEvents
    from ..metrics import TierMetrics
    from ..undo import UndoLog


class TierHit(NamedTuple):
    """One page of a hash chain that a tier holds."""

    page_hash: int
    token_bytes: bytes
    handle: Any
    """The tier's own reference to the page: a host page, a page's bytes per shard."""


class DeviceHit(NamedTuple):
    """A page a request found in the device index, with the chain around it."""

    page_id: int
    page_hash: int
    parent_hash: int | None
    """The hash of the page before it; None for a sequence's first page."""
    keys: EventKeys | None
    """What events say of the page besides its tokens (the request's salt on a first
    page, its adapter, images, session), or None."""


@dataclass(frozen=True, slots=True)
class CommittedPages:
    """Device pages that one `step` newly indexed, parents before their children."""

    page_ids: list[int]
    hashes: list[int]
    token_bytes: list[bytes]
    parents: list[int | None]
    keys: list[EventKeys | None]


class Tier(Protocol):
    """The core every tier implements: one replica's view of it. Every call is all or
    nothing for the tier's own state, and no call raises for a page the tier lacks or a
    backend that fails: that is a miss. What a tier may do besides is a capability of
    its own (below), which the stack checks once, when it is built (`TierStack`)."""

    name: str
    """The config's name (`TierConfig.name`)."""
    shared: bool
    """True when other replicas and servers see the same pages (the Redis tier): a
    replica's own prefix is then no reason to route a request to it."""

    def lookup(self, chain: Iterator[tuple[int, bytes]]) -> list[TierHit]:
        """The leading pages of `chain` ((page hash, token bytes) in chain order) that
        the tier holds, token bytes compared; stops at the first page it lacks. May read
        the whole chain. Changes nothing but the tier's counters."""
        ...

    def load(self, hits: Sequence[TierHit], device_pages: Sequence[int]) -> None:
        """Copies each hit (pinned, if the tier pins) into its device page (owned by the
        request, not yet indexed); writes nothing else, so a failure leaves the loads to
        run again."""
        ...

    def store(self, pages: CommittedPages) -> None:
        """Keeps (or queues) copies of pages `step` newly committed on the device. Best
        effort: a page that finds no room is not stored. A failure may leave the tier
        with fewer pages, never a hash over other bytes."""
        ...

    def reset(self) -> None:
        """`reset_prefix_cache`: forgets what this replica stored, where it can (pinned
        hits still load)."""
        ...

    def close(self) -> None:
        """Sends what is queued (a bounded wait) and releases connections and threads."""
        ...

    def metrics(self) -> TierMetrics:
        """The tier's pages and bytes (`cache_tokens` is the replica's count)."""
        ...

    def reset_metrics(self) -> None:
        """Zeroes the counters `metrics` reports."""
        ...


@runtime_checkable
class Undoable(Protocol):
    """A tier with state of its own to undo (the host tier; the shared tier's stored
    pages are the server's, and its hits carry their bytes)."""

    undo: UndoLog | None
    """The manager's undo log (`mokv.undo`, set by `TierStack`): every call that changes
    the tier's state records there how to undo it, before it returns, so that a manager
    call that raises afterwards can roll the tier back. What cannot be undone (bytes
    sent to a server, a page overwritten) must leave a state the tier accepts: fewer
    pages, never a hash over other bytes."""


@runtime_checkable
class Pinning(Protocol):
    """A tier whose hits must be held from the reservation to the load (the host tier
    evicts; the shared tier's hits carry their bytes)."""

    def pin(self, hits: Sequence[TierHit]) -> None:
        """A reservation holding `hits` was applied: until `unpin`, `load` of them must
        find their bytes (nothing evicts or overwrites them). Cannot fail half-way."""
        ...

    def unpin(self, hits: Sequence[TierHit]) -> None:
        """The reservation of `hits` was loaded or dropped. Cannot fail half-way."""
        ...


@runtime_checkable
class PrefixPinning(Protocol):
    """A tier that keeps pinned prefixes until their pins end (`mokv.PinConfig`): the
    device may then evict a pinned page the tier holds (`holds_pinned`)."""

    def pin_prefixes(self, page_hashes: Sequence[int]) -> None:
        """Live pins hold these hashes (none held them before): the tier never evicts
        their pages, held now or stored later. Cannot fail half-way."""
        ...

    def unpin_prefixes(self, page_hashes: Sequence[int]) -> None:
        """No live pin holds these hashes any more. Cannot fail half-way."""
        ...

    def holds_pinned(self, page_hash: int) -> bool:
        """Whether the tier holds this pinned hash's page (pure)."""
        ...

    def holds(self, page_hash: int) -> bool:
        """Whether the tier holds this hash's page, pinned or not (pure): a pin may be
        granted for it."""
        ...


@runtime_checkable
class Retaining(Protocol):
    """A tier that keeps the pages of open sessions longest (`mokv.SessionConfig`; the
    shared tier's server evicts by itself)."""

    def retain(self, page_hashes: Sequence[int]) -> None:
        """Open sessions retain these hashes (none retained them before): the tier evicts
        their pages, held now or stored later, only after every page not retained.
        Cannot fail half-way."""
        ...

    def unretain(self, page_hashes: Sequence[int], old_end: bool) -> None:
        """No open session retains these hashes any more: their pages become ordinary
        cached pages, the first evicted (`old_end`: their sessions ended) or the last
        (the share cap dropped them). Cannot fail half-way."""
        ...


@runtime_checkable
class ReservationNoticed(Protocol):
    """A tier told what each reservation took on the device (the host tier refreshes
    its copies of device hits and counts hits for `min_hits`)."""

    def note_reserved(
        self, fresh_pages: Sequence[int], device_hits: Sequence[Sequence[DeviceHit]]
    ) -> None:
        """After a reservation: the pool handed out `fresh_pages`, and each request took
        its run of `device_hits` (chain order). Refreshes or counts; changes no page."""
        ...


@runtime_checkable
class Publishing(Protocol):
    """A tier whose stores (and evictions) the replica's KV-cache events announce."""

    def publish_to(self, events: TierEvents) -> None:
        """Reports the tier's stores and evictions to the replica's event recorder."""
        ...


@runtime_checkable
class Checked(Protocol):
    """A tier with invariants of its own (`enable_runtime_checks`)."""

    def check_invariants(self, pinned: Sequence[TierHit]) -> None:
        """InvariantError unless the tier is consistent and `pinned` (the replica's
        pending loads from this tier) is exactly what it holds pinned, each hit still
        holding its own tokens."""
        ...


class ChainTail:
    """A request's hash chain past its device hits, hashed once as the tiers read it.

    The first tier reads `pages(0)` and stops at its first miss; the next tier reads
    `pages(number of hits so far)`, from the page the one before it lacked, without
    hashing the pages again.
    """

    __slots__ = ("_pages", "_rest")

    def __init__(self, first: tuple[int, bytes], rest: Iterator[tuple[int, bytes]]) -> None:
        self._pages = [first]
        self._rest = rest

    def pages(self, start: int) -> Iterator[tuple[int, bytes]]:
        """(page hash, token bytes) from page `start` of the tail on."""
        pages, i = self._pages, start
        while True:
            while i >= len(pages):
                page = next(self._rest, None)
                if page is None:
                    return
                pages.append(page)
            yield pages[i]
            i += 1
