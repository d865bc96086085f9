"""ReservationPlanner: what reserving one request takes, worked out as a value.

A replica (`replica.py`) answers a request that holds its steps already (`HELD`, most
decode steps) itself; every other reservation is planned here, without changing
anything: the device hits that continue the request's hash chain (`prefix.py`), then,
while the plan fits, each tier's hits after them, and the fresh pages the rest takes
(`Reservation`, `plans.py`), with the room the pool has for them. The replica's `fits`
checks a batch of plans against the pool, its `apply` takes them.

A cache of several groups or a sliding window plans through its joint prefix hit
(`JointGroups.plan`, `groups/joint.py`); the paths below are tuned for one full group.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...cache.extra_keys import request_keys
from ...context import TextGenerationContext, check_cache_control
from ...tiers.stack import PendingLoad
from .plans import RequestState, Reservation
from .replica_parts import ReplicaParts


class ReservationPlanner:
    """Plans the reservations of one replica's requests (see the module docstring) over
    its `parts`: its first group's pool, chains and tiers, its groups' joint hit (None
    for one full group), and whether it has pins (a request's `cache_control` asking
    for one is refused without)."""

    def __init__(self, parts: ReplicaParts, page_size: int, max_seq_len: int) -> None:
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.pool = parts.groups[0].pool
        self.chains = parts.chains
        self.tiers = parts.group_tiers[0]
        self._tiered = bool(self.tiers)  # read on every plan
        self.joint = parts.joint
        self.pins_on = parts.pins is not None

    def plan(
        self, ctx: TextGenerationContext, req: RequestState, num_steps: int, needed: int
    ) -> Reservation:
        """What reserving `ctx` (of the claimed `req`, its window checked) for
        `num_steps` steps takes, up to token `needed`, past the pages it holds: a
        `Reservation` that `fits` when the pool could take it alone now. Raises for a
        request that is too long. Pure, but for what the chain memo remembers of its
        readings and the tiers' lookup counters.

        The cases, cheapest first (a scheduler asks for every running request at every
        step, and for a waiting prompt at every step until it fits; the replica answers
        a request that holds its window already, `HELD`, before it asks here):

            fresh    no prefix can extend the request, which holds pages    fresh pages
                     (a decode step onto a new page; a prompt's next chunk   only, no
                     without a prefix to match: `takes_fresh_only`)          lookup
            refused  a waiting prompt retried as it was refused last          that refusal
                     (`PrefixChains.refused_again`)                          (the memo's)
            else     device hits, then each tier's                          a full plan
        """
        if needed <= self.max_seq_len:  # past it, `plan_hits` raises
            if self.joint is not None:
                if not req.pages:  # a first reservation: its keys and control are checked
                    request_keys(ctx)
                    self.check_control(ctx)
                return self.joint.plan(ctx, req, num_steps, self.max_seq_len)
            if req.pages:
                if self.takes_fresh_only(ctx, req):
                    plan = self.reservation(ctx, req, num_steps, (), [])
                    plan.room = self.pool.num_free  # `pool.room(())`: no hit to revive
                    return plan
            else:
                refused = self.chains.refused_again(ctx, req, num_steps)
                if refused is not None:
                    return refused
        return self.plan_hits(ctx, req, num_steps)

    def plan_hits(
        self, ctx: TextGenerationContext, req: RequestState, num_steps: int
    ) -> Reservation:
        """`plan`'s last case: the device hits that continue the request's chain, then,
        while the plan fits, each tier's hits after them."""
        if not req.pages:  # a first reservation: every key is checked before any is used
            request_keys(ctx)
            self.check_control(ctx)
        hits, tail = self.chains.device_hits(ctx, req, want_tail=self._tiered)
        plan = self.reservation(ctx, req, num_steps, hits, [])
        plan.room = room = self.chains.room(ctx.request_id, hits, plan.num_fresh)
        if tail is None:
            if room < plan.num_fresh and not req.pages and not self._tiered:
                self.chains.note_refusal(ctx, num_steps, plan)
            return plan
        loads: list[PendingLoad] = []
        parent = hits[-1][1] if hits else plan.parent_hash
        keys, first = request_keys(ctx), len(req.hashes) + len(hits)
        for index, tier in enumerate(self.tiers):
            # A tier hit needs a fresh device page as a miss does, and more hits only
            # move the window further: a plan that does not fit cannot be made to fit
            # by a lower tier, so it is not asked. That walk was most of the host tier's
            # cost: a request at the head of the queue is retried every step until pages
            # free up, and on the trace replay 97% of the host pages matched belonged to
            # such tries; and the shared tier would fetch the same bytes at every retry.
            if not plan.fits:
                break
            found = tier.lookup(tail.pages(len(loads)))
            if not found:
                continue
            for hit in found:
                page_keys = keys.page(first + len(loads), self.page_size) if keys else None
                loads.append(PendingLoad(index, hit, parent, page_keys))
                parent = hit.page_hash
            plan = self.reservation(ctx, req, num_steps, hits, loads)
            plan.room = room
        return plan

    def check_control(self, ctx: TextGenerationContext) -> None:
        """TypeError for a `cache_control` that is not a `mokv.CacheControl`; ValueError
        for a pin on a replica without `params.pins` (never accepted and ignored)."""
        control = check_cache_control(getattr(ctx, "cache_control", None))
        if control is not None and control.pin_ttl_s is not None and not self.pins_on:
            raise ValueError(
                f"request {ctx.request_id!r} asks for a pin (cache_control.pin_ttl_s="
                f"{control.pin_ttl_s!r}) but KVCacheParams.pins is None"
            )

    def takes_fresh_only(self, ctx: TextGenerationContext, req: RequestState) -> bool:
        """Whether reserving `ctx` can take fresh pages only, and no prefix: none may
        extend it (`PrefixChains.can_match`), or it has no page left to look for (a decode
        step onto a new page). Then `plan` asks for no hit."""
        last_page = (ctx.end_idx - 1) // self.page_size  # the last one a prefix may reach
        return last_page <= len(req.hashes) or not self.chains.can_match(ctx, req)

    def reservation(
        self,
        ctx: TextGenerationContext,
        req: RequestState,
        num_steps: int,
        hits: Sequence[tuple[int, int]],
        loads: list[PendingLoad],
    ) -> Reservation:
        """The reservation of `ctx` with these hits (`RequestState.reservation_size`; a
        load takes a fresh page)."""
        hit_tokens, num_new = req.reservation_size(
            ctx, len(hits) + len(loads), num_steps, self.page_size, self.max_seq_len
        )
        parent = req.hashes[-1] if req.hashes else None
        return Reservation(ctx, req, hits, hit_tokens, num_new + len(loads), list(loads), parent)
