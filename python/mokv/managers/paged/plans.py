"""What a paged replica holds per request, and what its calls will do, worked out before
anything changes (`PagedReplica.plan`, `plan_commit`)."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from ...cache.extra_keys import EventKeys, request_keys
from ...config.cache_control import CacheControl
from ...context import TextGenerationContext
from ...errors import StaleContextError
from ...tiers.base import DeviceHit
from ...tiers.stack import PendingLoad
from ..base import sequence_too_long


@dataclass(eq=False, slots=True)
class Session:
    """One open session of a replica (`SessionTable`, sessions.py), which its requests
    name."""

    session_id: str
    chain: tuple[int, ...] = ()
    """The hash chain it retains, root first."""
    deadline: float = math.inf
    """When it ends unless a request of it runs (its last release + `ttl_s`)."""
    running: int = 0
    """Its requests the replica holds (reserved at least once, not released)."""


@dataclass(slots=True)
class RequestState:
    """A claimed request: its row of the page table, its pages and their hash chain.

    `hashes` covers the first `len(hashes)` pages (committed, or found in the index or
    a tier); `loads` are tier hits reserved for it and not yet copied in. `prompt_end`
    is the context's `end_idx` at its first fetch (its prompt: nothing was generated
    before), -1 until then; the metrics count only prompt tokens. `session` is the open
    session it belongs to (`SessionTable.start`, at its first reservation), if any.

    Groups. `pages` is the row of the replica's first cache group: page index `i`'s page.
    In a replica of several groups or a sliding window (`groups/joint.py`), `rows` holds
    every group's row (`rows[0] is pages`), all as long as `pages`, and `firsts[g]` is
    the first page index group `g` holds: a sliding-window group releases the pages
    that left its window, and their entries below `firsts[g]` are stale (never read; the
    group's page table holds the pad page there). With one full group both are empty.
    """

    slot: int
    prompt_end: int = -1
    pages: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    loads: list[PendingLoad] = field(default_factory=list)
    session: Session | None = None
    rows: tuple[list[int], ...] = ()
    firsts: list[int] = field(default_factory=list)
    control: CacheControl | None = None
    """What the request asked of the cache (`ctx.cache_control` at its first
    reservation): its pin at release, its write policy."""
    num_withheld: int = 0
    """Full pages its write policy kept out of the index so far."""
    hit_end: int = 0
    """With groups: the page index after the last joint prefix hit it took (0: none);
    a sliding group keeps the window before it (`JointGroups.keep_ends`)."""

    def check_window(self, ctx: TextGenerationContext, page_size: int) -> None:
        """StaleContextError unless the context's cache ends between the request's
        committed pages (shared pages it never writes again) and the end of its pages."""
        if ctx.start_idx < len(self.hashes) * page_size:
            raise StaleContextError(
                f"request {ctx.request_id!r} has start_idx={ctx.start_idx}, inside its "
                f"{len(self.hashes) * page_size} committed tokens (pages other requests may "
                "share): release the request before ctx.reset()"
            )
        if ctx.start_idx > len(self.pages) * page_size:
            raise StaleContextError(
                f"request {ctx.request_id!r} has start_idx={ctx.start_idx} but only "
                f"{len(self.pages) * page_size} token slots were fetched for it"
            )

    def reservation_size(
        self,
        ctx: TextGenerationContext,
        num_hits: int,
        num_steps: int,
        page_size: int,
        max_seq_len: int,
    ) -> tuple[int, int]:
        """Where `ctx`'s cache ends after `num_hits` hits (device pages and tier loads)
        continue the request's committed pages, and the pages after them that reserving
        it for `num_steps` steps takes (each step after the first adds one token).
        SequenceTooLongError past `max_seq_len`."""
        hit_tokens = (len(self.hashes) + num_hits) * page_size if num_hits else ctx.start_idx
        # Where the window ends after a hit is the context's rule, not the manager's.
        active_idx = ctx.active_idx_after_skip(hit_tokens) if num_hits else ctx.active_idx
        needed = active_idx + num_steps - 1
        if needed > max_seq_len:
            raise sequence_too_long(ctx.request_id, needed, num_steps, max_seq_len)
        return hit_tokens, max(-(-needed // page_size) - len(self.pages) - num_hits, 0)


class Held(enum.Enum):
    """The plan of a request that holds the steps asked already: nothing to take."""

    HELD = "held"


HELD: Final = Held.HELD
"""`PagedReplica.plan`'s answer for a window held already (most decode steps)."""


@dataclass(slots=True)
class JointHit:
    """The prefix every cache group of a replica can serve at once (`groups/joint.py`):
    `len(hashes)` pages continuing a request's chain, of which group `g` takes the
    last `len(pages[g])` (a full group all of them, a sliding-window group those its
    window reads from the hit's end): each a device page id, or a tier hit that a fresh
    device page will load (a `PendingLoad` without its page yet)."""

    hashes: list[int]
    pages: list[list[int | PendingLoad]]
    checkpoint: int | None = None
    """The recurrent state's checkpoint at the hit's end (`groups/state.py`), in a
    replica with state layers."""
    num_device: int = -1
    """Pages of the joint hit the groups' device pages alone serve (the rest need a
    tier's pages in some group); -1: all of them (a replica without tiers)."""
    slowest_tier: int = 0
    """The last tier (in lookup order) any group loads a page of the hit from: the
    hit's tokens past `num_device` count as that tier's (`TierStack.count_tokens`)."""

    def device_pages(self, g: int) -> list[int]:
        """Group `g`'s device pages of the hit."""
        return [p for p in self.pages[g] if isinstance(p, int)]

    def num_loads(self, g: int) -> int:
        """Group `g`'s pages of the hit that a tier holds (each takes a fresh page)."""
        return sum(p.__class__ is not int for p in self.pages[g])


@dataclass(slots=True)
class Reservation:
    """What reserving one request will do, worked out before anything changes
    (`PagedReplica.plan`); `PagedReplica.apply` does it. vLLM's `KVCacheBlocks` and
    mini-sglang's `MatchResult` are the models: a value the scheduler-facing call
    hands from the planning half to the changing half.

    A refused plan of a waiting prompt may be the chain memo's own, handed out again
    at its retries (`PrefixChains.refused_again`): read it, never keep it."""

    ctx: TextGenerationContext
    req: RequestState
    hits: Sequence[tuple[int, int]]
    """(page id, hash) of device pages that continue its chain."""
    hit_tokens: int
    """Where its cache ends after every hit (device and tiers)."""
    num_fresh: int
    """Fresh device pages the reservation takes: its new pages (to allocate after the
    hits) and its loads. A field, not a property: read on every reservation."""
    loads: list[PendingLoad]
    """Tier hits after the device hits, each needing a fresh page (no page yet)."""
    parent_hash: int | None
    """The hash its first hit chains from: its last committed page's (None: none)."""
    room: int = 0
    """Fresh pages the pool could hand out with `hits` taken, when it was planned (for a
    plan that does not fit, possibly an earlier, larger reading: `PrefixChains.room`).
    With several groups, the least of every group's room (each takes `num_fresh`)."""
    joint: JointHit | None = None
    """With several groups or a sliding window: the joint prefix hit, whose pages each
    group takes (`hits` is then empty); None: no hit, or one full group."""

    @property
    def fits(self) -> bool:
        """Whether the pool could take this reservation alone, as it stood when planned."""
        return self.num_fresh <= self.room

    def device_hit_run(self, page_size: int) -> list[DeviceHit]:
        """The device hits, each with the hash before it and its `EventKeys`."""
        parent, keys = self.parent_hash, request_keys(self.ctx)
        first = self.hit_tokens // page_size - len(self.hits) - len(self.loads)
        run = []
        for page_idx, (page_id, page_hash) in enumerate(self.hits, start=first):
            page_keys = keys.page(page_idx, page_size) if keys is not None else None
            run.append(DeviceHit(page_id, page_hash, parent, page_keys))
            parent = page_hash
        return run


@dataclass(slots=True)
class CommitPlan:
    """The pages one `step` commits in a replica: parallel columns, one row a page."""

    requests: list[tuple[RequestState, list[int]]]
    """Each request with pages to commit, and its new chain hashes."""
    owners: list[tuple[RequestState, int]]
    """The request holding each page, and the page's index in its pages."""
    page_ids: list[int]
    hashes: list[int]
    datas: list[bytes]
    parents: list[int | None]
    keys: list[EventKeys | None]
    withheld: list[tuple[RequestState, int]] = field(default_factory=list)
    """Requests whose write policy kept full pages out of the index: each with how
    many it keeps out now (`RequestState.num_withheld` becomes that)."""
