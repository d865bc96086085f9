"""PagedKVCacheManager: fixed-size pages, prefix cache, data- and tensor-parallel replicas.

The request lifecycle (the manager contract of base.py, in MAX's spelling):

    external_claim(request_id, replica_idx)   # or claim(); binds the request to a replica
    maybe_reserve(ctx, num_steps) -> bool      # or alloc(), which raises instead of False
    fetch(batch, num_steps) -> inputs          # or get_runtime_inputs(); feeds the graph
    ... run the model, ctx.update(token) ...
    step(batch)                                # commits pages that became full
    release(request_id)

This class routes each request to its data-parallel replica (`replica.py`: one page
pool, its buffers and its tiers) and keeps the contract's promises across them: every
request of a batch is checked and planned before any replica changes, and every call
that changes something runs under the manager's undo log (`mokv.undo`), shared by the
replicas, their pools and tiers and the event recorders: a call that raises, from
anywhere inside, is rolled back (docs/reliability.md says what stands). Memory sizing is
`sizing.py`, the metrics `metrics.py`, MAX's multistep helpers `multistep.py` (functions
its methods call); the graph inputs are built by `inputs.py`. The tiers below the device
pages (`params.tiers`: host memory, a shared Redis store) are `mokv.tiers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from max.driver import Buffer, Device
from max.engine import InferenceSession
from max.nn.kv_cache import RecurrentStateInputsPerDevice

from ...cache.hashing import page_hash_fn, root_hash
from ...config.cache_control import CacheControl
from ...config.events import KVEventsConfig
from ...config.params import KVCacheParams, with_manager_events
from ...context import RequestID, TextGenerationContext
from ...errors import (
    AlreadyClaimedError,
    BatchTooLargeError,
    InsufficientMemoryError,
    InsufficientPagesError,
    InvalidReplicaError,
    UnknownRequestError,
)
from ...layouts import PAGED
from ...layouts.paged import PagedInputs
from ...metrics import KVCacheMetrics
from ...registry import BUILDERS
from ...remote import RemoteMetrics
from ..base import (
    MaxManagerAPI,
    atomic,
    check_distinct,
    check_num_steps,
    check_request_id,
    check_window,
    synchronized,
)
from ..increment import CacheLengthIncrementer
from . import multistep, sizing
from .inputs import ceil_div
from .metrics import cache_metrics, num_free_pages, shared_tier_metrics
from .pins import NO_GRANT, PinGrant
from .plans import HELD
from .replica import PagedReplica, Reservation
from .replica_parts import build_replica_parts
from .sizing import check_devices_hold, replica_pages

_request_id = attrgetter("request_id")  # of a context


class PagedKVCacheManager(MaxManagerAPI):
    """Paged KV cache manager with data and tensor parallelism support.

    Args:
        params: cache shape, prefix cache, tiers and events (see `KVCacheParams`).
        max_batch_size: most requests held at once, over all replicas together.
        max_seq_len: most tokens one request may hold.
        num_layers: transformer layers; each page holds K and V of every layer.
        devices: `params.n_devices` devices; replica `r` owns
            `devices[r * tp : (r + 1) * tp]` with `tp = params.tensor_parallel_degree`.
        session: the InferenceSession that runs the model (and the small graph of
            `increment_cache_lengths`).
        available_cache_memory: bytes for KV pages over all devices.
        zmq_endpoint_base: MAX's spelling of `params.kv_events =
            KVEventsConfig(endpoint=zmq_endpoint_base)` (`with_manager_events`).
        kv_events_config: the same for a whole `KVEventsConfig`; `self.params` carries
            the events either gives.
        page_size: kept for signature compatibility; must equal `params.page_size`
            unless left at its default.
        enable_runtime_checks: verify the pools' invariants after every operation.
    """

    def __init__(
        self,
        params: KVCacheParams,
        max_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
        session: InferenceSession,
        available_cache_memory: int,
        zmq_endpoint_base: str | None = None,
        page_size: int = 128,
        enable_runtime_checks: bool = False,
        kv_events_config: KVEventsConfig | None = None,
    ) -> None:
        params = with_manager_events(params, zmq_endpoint_base, kv_events_config)
        super().__init__(params, PAGED, max_batch_size, max_seq_len, num_layers, devices, session)
        if page_size != 128 and page_size != params.page_size:
            raise ValueError(
                f"page_size={page_size} disagrees with params.page_size={params.page_size}; "
                "set it in KVCacheParams"
            )
        if available_cache_memory.__class__ is not int or available_cache_memory < 0:
            raise TypeError(
                f"available_cache_memory must be a number of bytes (an int >= 0), "
                f"got {available_cache_memory!r}"
            )
        check_devices_hold(params, available_cache_memory, self.devices)
        dp = params.data_parallel_degree
        params.cache_groups(num_layers)  # ValueError for groups' layers that do not add up
        num_pages, slots = replica_pages(params, num_layers, available_cache_memory, max_seq_len)
        if max_batch_size < dp:
            raise ValueError(
                f"max_batch_size={max_batch_size} is smaller than data_parallel_degree={dp}"
            )
        hash_fn = page_hash_fn(params.prefix_hash)
        root = root_hash(params.prefix_hash, params.prefix_hash_seed, params.page_format)
        tp = params.tensor_parallel_degree
        self.replicas: list[PagedReplica] = []
        try:
            for r in range(dp):
                self.replicas.append(
                    PagedReplica(
                        build_replica_parts(
                            params,
                            num_pages,
                            ceil_div(max_batch_size, dp),
                            max_seq_len,
                            num_layers,
                            list(self.devices[r * tp : (r + 1) * tp]),
                            hash_fn,
                            root,
                            self._undo,
                            slots,
                        )
                    )
                )
            # One publisher per replica (its own PUB socket), opened last so that nothing
            # after it can fail; the replica's pool and tiers tell it what changed.
            self.kv_event_publishers = (
                BUILDERS.build(params.kv_events, params.page_size, dp) if params.kv_events else []
            )
        except BaseException as e:
            for replica in self.replicas:  # their tiers may run threads
                replica.close()
            if isinstance(e, MemoryError):  # the page table and pool lists, in host memory
                raise InsufficientMemoryError(
                    f"max_batch_size={max_batch_size}, max_seq_len={max_seq_len} and "
                    f"{num_pages} pages per replica: the manager's tables do not fit in host "
                    f"memory ({e})"
                ) from None
            raise
        for replica, publisher in zip(self.replicas, self.kv_event_publishers):
            replica.publish_to(publisher)
        self.page_size = params.page_size
        self.total_num_pages = self.replicas[0].num_pages * dp
        self.enable_runtime_checks = enable_runtime_checks
        self._replica_of: dict[RequestID, int] = {}
        self._increment = CacheLengthIncrementer(session, with_max_lengths=True)

    # --- routing between replicas ---------------------------------------------------
    # `_replica_of` maps each claimed request to its replica's index; a new request goes
    # where its prompt's longest cached prefix is, among the replicas with a free request
    # slot (`_recommend`).

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def _replica(self, request_id: RequestID) -> PagedReplica:
        return self.replicas[self._replica_index(request_id)]

    def _replica_index(self, request_id: RequestID) -> int:
        try:
            return self._replica_of[request_id]  # only str ids are ever stored
        except (KeyError, TypeError):
            check_request_id(request_id)
            raise UnknownRequestError(request_id) from None

    @synchronized
    def contains(self, request_id: RequestID) -> bool:
        check_request_id(request_id)
        return request_id in self._replica_of

    @synchronized
    def get_replica(self, context: TextGenerationContext) -> int:
        return self._replica_index(context.request_id)

    @synchronized
    def prefix_hit_pages(self, context: TextGenerationContext) -> list[tuple[int, int]]:
        """Per replica, the pages of `context`'s prompt it could serve: from its device
        pages, and from its own tiers after them (MAX's `get_prefix_cache_hit_counts`;
        a shared tier is not asked). Changes nothing."""
        return [replica.prefix_hit_pages(context) for replica in self.replicas]

    @synchronized
    def get_or_recommend_replica(self, context: TextGenerationContext) -> int:
        """The request's replica if claimed; else the one `_recommend` picks for it."""
        if context.request_id in self._replica_of:
            return self._replica_of[context.request_id]
        return self._recommend(context)

    def _recommend(self, context: TextGenerationContext | None) -> int:
        """The replica for a new request: one with a free request slot while any has one
        (a full one would refuse the claim); among those the one holding the longest
        cached prefix of `context`'s tokens (mokv's addition: MAX 25.7 ignores prefixes
        here), then MAX's rule, the fewest requests, then the most free pages; the
        lowest index on a tie."""
        if self.num_replicas == 1:
            return 0

        def rank(r: int) -> tuple[bool, int, int, int]:
            replica = self.replicas[r]
            hits = sum(replica.prefix_hit_pages(context)) if context is not None else 0
            return (replica.num_free_slots > 0, hits, -replica.num_requests, replica.num_free_pages)

        return max(range(self.num_replicas), key=rank)

    # --- requests -------------------------------------------------------------------

    @atomic
    def external_claim(self, request_id: RequestID, replica_idx: int | None = None) -> None:
        """Binds `request_id` to a replica: by default the one `_recommend` picks with no
        prefix to match (MAX 25.7 raises ValueError instead when there are several)."""
        check_request_id(request_id)
        if replica_idx is None:
            replica_idx = self._recommend(None) if len(self.replicas) > 1 else 0
        replica_index(replica_idx, len(self.replicas))
        if request_id in self._replica_of:
            raise AlreadyClaimedError(request_id)
        self.replicas[replica_idx].claim(request_id)
        self._replica_of[request_id] = replica_idx
        self._undo.push(self._replica_of.pop, request_id)
        self._after_change()

    @atomic
    def release(self, request_id: RequestID) -> None:
        """Frees the request's pages (hashed ones stay reusable) and forgets it."""
        replica_idx = self._replica_index(request_id)
        self.replicas[replica_idx].release(request_id)
        del self._replica_of[request_id]
        self._undo.push(self._replica_of.__setitem__, request_id, replica_idx)
        self._after_change()

    @atomic
    def end_session(self, session_id: str) -> int:
        """Ends the session `session_id` (`KVCacheParams.sessions`): the pages it retains
        become ordinary cached pages, the first to be evicted. Requests of it still
        running keep their pages, and their release retains nothing. Sessions past their
        time-to-live end first. Returns the pages (distinct hashes per replica) no open
        session retains any more; 0 when nothing was retained (a session never opened,
        ended or expired already; sessions off). TypeError for a `session_id` that is
        not a non-empty str."""
        if not isinstance(session_id, str) or not session_id:
            raise TypeError(f"session_id must be a non-empty str, got {session_id!r}")
        plans = [(r.sessions, r.sessions.plan_end(session_id)) for r in self.replicas if r.sessions]
        ended = sum(table.apply(plan) for table, plan in plans)
        self._after_change()
        return ended

    @atomic
    def pin(self, request_id: RequestID, ttl_s: float, num_tokens: int | None = None) -> PinGrant:
        """Pins the first `num_tokens` tokens (whole pages; None: all) of the request's
        committed or found pages for `ttl_s` seconds (`KVCacheParams.pins`): while the
        pin lives they are never evicted (but to a host tier that keeps them), and a
        reservation that hits all of them renews it. The budget may grant fewer pages
        (`PinGrant` says how many); pinning a prefix pinned already renews that pin.
        ValueError without `params.pins` or for a `ttl_s` that is not > 0."""
        self._check_pin(ttl_s, num_tokens)
        grant = self._replica(request_id).pin_request(request_id, ttl_s, num_tokens)
        self._after_change()
        return grant

    @atomic
    def pin_session(self, session_id: str, ttl_s: float) -> PinGrant:
        """Pins the chain the open session `session_id` retains (a session pausing for
        longer than its time to live), in each replica that holds it; `pin`'s grant,
        summed over them (nothing requested for a session that retains nothing)."""
        if not isinstance(session_id, str) or not session_id:
            raise TypeError(f"session_id must be a non-empty str, got {session_id!r}")
        self._check_pin(ttl_s, None)
        grants = [
            r.pin(r.sessions.retained(session_id), ttl_s, None)
            for r in self.replicas
            if r.sessions is not None and r.sessions.retained(session_id)
        ]
        self._after_change()
        return PinGrant(
            sum(g.requested_tokens for g in grants),
            sum(g.pinned_tokens for g in grants),
            max((g.expires_at for g in grants), default=NO_GRANT.expires_at),
        )

    def _check_pin(self, ttl_s: float, num_tokens: int | None) -> None:
        if self.params.pins is None:
            raise ValueError("pin needs KVCacheParams.pins (mokv.PinConfig), which is None")
        CacheControl(pin_ttl_s=ttl_s, pin_tokens=num_tokens)  # raises naming a bad value

    @synchronized
    def get_req_blocks(self, request_id: RequestID) -> list[int]:
        """Page ids the request holds, in token order (in the first cache group)."""
        return self._replica(request_id).pages_of(request_id)

    @synchronized
    def get_req_blocks_per_group(self, request_id: RequestID) -> dict[str, tuple[int, list[int]]]:
        """Per cache group (by name, in `params.groups` order): the first page index the
        request holds there (a sliding window's pages before it were released) and the
        page ids it holds from there on, in token order."""
        return self._replica(request_id).pages_by_group(request_id)

    @synchronized
    def state_inputs(
        self, batch: Sequence[TextGenerationContext]
    ) -> list[RecurrentStateInputsPerDevice]:
        """The graph inputs of the state layers (`KVCacheParams.recurrent`) for `batch`,
        after its `fetch`: MAX's `RecurrentStateInputsPerDevice`, one per device, replica
        by replica as `fetch`'s. ValueError when the cache has no state layers."""
        if self.params.recurrent is None:
            raise ValueError("state_inputs: this cache has no recurrent state (params.recurrent)")
        ids: list[list[RequestID]] = [[] for _ in self.replicas]
        for ctx in batch:
            ids[self._replica_index(ctx.request_id)].append(ctx.request_id)
        return [x for replica, r in zip(self.replicas, ids) for x in replica.state_inputs(r)]

    # --- steps ----------------------------------------------------------------------

    def maybe_reserve(self, data: TextGenerationContext, num_steps: int = 1) -> bool:
        """Holds the pages `data` needs for `num_steps` steps, reusing its cached prefix.

        Returns False, changing nothing (but ending the sessions and pins past their time
        to live, whose pages are room), when they do not fit; after True, `fetch` for
        the same steps cannot run out of pages. On a prefix hit the context moves its
        window past the reused tokens (`data.skip_cached_prefix`).
        """
        # The lock is taken here rather than by @synchronized: this is the one call made
        # per request per step, and the wrapper's extra frame measured ~0.15 µs of it.
        self._lock.acquire()
        try:
            if num_steps.__class__ is not int or num_steps < 1:
                check_num_steps(num_steps)  # raises
            try:  # `_replica`, inlined
                replica = self.replicas[self._replica_of[data.request_id]]
            except (KeyError, TypeError):
                replica = self._replica(data.request_id)  # raises the caller's error
            plan = replica.plan(data, num_steps)
            if plan is HELD:
                return True
            if not plan.fits:  # asked of the pool once, by `plan`; nothing changed since
                return self._undo.run(self._reserve_after_expiry, replica, data, num_steps)
            self._undo.run(self._apply, replica, plan)
            return True
        finally:
            self._lock.release()

    def _reserve_after_expiry(
        self, replica: PagedReplica, data: TextGenerationContext, num_steps: int
    ) -> bool:
        """A reservation that did not fit ends the overdue sessions and pins (what they
        held is room) and plans again: one bracket, so a failure in the second plan undoes
        the ending too."""
        if not replica.end_overdue():
            return False
        plan = replica.plan(data, num_steps)
        if plan is HELD or not plan.fits:
            return plan is HELD
        self._apply(replica, plan)
        return True

    def _apply(self, replica: PagedReplica, plan: Reservation) -> None:
        replica.apply([plan])
        self._after_change()

    @atomic
    def fetch(
        self, batch: Sequence[TextGenerationContext], num_steps: int = 1
    ) -> list[PagedInputs[Buffer, Buffer]]:
        """Graph inputs for `batch`, one `RaggedKVCacheInputs` per device
        (`ScaledRaggedKVCacheInputs`, with the scales leaf, for scaled pages).

        The batch may mix replicas in any order: each replica's inputs describe its own
        requests in batch order (as MAX regroups a batch), and devices come replica by
        replica, so a model's rows go in that order (`get_data_parallel_splits` gives
        each replica's count). Requests not yet reserved are reserved here.
        All or nothing: every request is checked and every reservation planned before
        anything changes; `InsufficientPagesError` (and no change) if the pages of the
        batch do not fit. A reservation whose context moved its window (a prefix hit)
        stands even if something after it raises, as after `maybe_reserve`.
        """
        check_num_steps(num_steps)
        if len(batch) > self.max_batch_size:
            raise BatchTooLargeError(
                f"batch of {len(batch)} requests is larger than "
                f"max_batch_size={self.max_batch_size}"
            )
        groups: list[list[TextGenerationContext]] = [[] for _ in self.replicas]
        plans: list[list[Reservation]] = [[] for _ in self.replicas]
        for ctx in batch:
            r = self._replica_index(ctx.request_id)
            check_window(ctx)
            groups[r].append(ctx)
            plan = self.replicas[r].plan(ctx, num_steps)
            if plan is not HELD:
                plans[r].append(plan)
        if len(set(map(_request_id, batch))) != len(batch):
            check_distinct(batch)
        for r, (replica, replica_plans) in enumerate(zip(self.replicas, plans)):
            if replica_plans and not replica.fits(replica_plans):
                raise InsufficientPagesError(
                    f"requests {[p.ctx.request_id for p in replica_plans]} need "
                    f"{sum(p.num_fresh for p in replica_plans)} fresh pages of replica {r}, "
                    f"which has {replica.num_free_pages} free; call maybe_reserve before fetch"
                )
        for replica, replica_plans in zip(self.replicas, plans):
            if replica_plans:
                replica.apply(replica_plans)
        for replica, group in zip(self.replicas, groups):
            if replica.tiers:
                if self.enable_runtime_checks:
                    replica.check_loads()
                replica.load_pending(group)  # lower tiers reach the device before the graph
        if self.enable_runtime_checks:
            for replica, group in zip(self.replicas, groups):
                replica.check_tables(group, num_steps)
        inputs = [
            device_inputs
            for replica, group in zip(self.replicas, groups)
            for device_inputs in replica.runtime_inputs(group, num_steps)
        ]
        self._after_change()
        return inputs

    @synchronized
    def step(self, batch: Sequence[TextGenerationContext]) -> None:
        """Commits the pages that the batch's last step filled to the prefix cache.

        Every request is checked before any page is committed; the step's events are
        handed to the publishers once the commit can no longer be undone.
        """
        self._undo.run(self._commit, batch)
        for publisher in self.kv_event_publishers:  # one event batch per step
            publisher.end_step()

    def _commit(self, batch: Sequence[TextGenerationContext]) -> None:
        if len(set(map(_request_id, batch))) != len(batch):
            check_distinct(batch)
        if len(self.replicas) == 1:  # the replica finds each request, or raises as we would
            replica = self.replicas[0]
            replica.commit(replica.plan_commit(batch))
            replica.slide(batch)
        else:
            groups: list[list[TextGenerationContext]] = [[] for _ in self.replicas]
            for ctx in batch:
                groups[self._replica_index(ctx.request_id)].append(ctx)
            plans = [replica.plan_commit(group) for replica, group in zip(self.replicas, groups)]
            for replica, plan, group in zip(self.replicas, plans, groups):
                replica.commit(plan)
                replica.slide(group)
        self._after_change()

    @synchronized
    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix of the device and host tiers; False, changing and
        publishing nothing, while any request holds pages (vLLM's rule: release or preempt
        them first).

        A reset under running requests would leave them holding committed pages whose
        hashes the event stream had just cleared; the next page such a request commits
        would name a parent no router still knows, and its prefix would stay a duplicate
        that is never announced again. With nothing held, everything after the reset's
        `AllBlocksCleared` chains from pages announced after it.
        """
        if any(r.holds_pages for r in self.replicas):
            return False
        self._undo.run(self._reset_replicas)
        for publisher in self.kv_event_publishers:
            publisher.end_step()
        return True

    def _reset_replicas(self) -> None:
        for r in self.replicas:
            r.reset_prefix_cache()
        self._after_change()

    @synchronized
    def close(self) -> None:
        """Publishes the events still queued and closes the event sockets (if any); closes
        the tiers (the shared tier sends what it queued, a bounded wait, and disconnects)."""
        for publisher in self.kv_event_publishers:
            publisher.close()
        for replica in self.replicas:
            replica.close()

    @synchronized
    def check_invariants(self) -> None:
        """Raises InvariantError if any replica's bookkeeping is inconsistent."""
        for r in self.replicas:
            r.check_invariants()

    def _after_change(self) -> None:
        if self.enable_runtime_checks:
            self.check_invariants()

    # --- metrics (metrics.py) -------------------------------------------------------

    @property
    @synchronized
    def num_free_blocks(self) -> int:
        """Pages that can be handed out now (cached-free pages included), all replicas."""
        return num_free_pages(self.replicas)

    @synchronized
    def page_counts(self, replica_idx: int) -> tuple[int, int]:
        """(free, total) pages of one replica, every group's: free counts cached-free
        pages too; with a shared budget (groups), slots (free: slots' worth)."""
        replica = self.replicas[replica_index(replica_idx, len(self.replicas))]
        return replica.num_free_pages, replica.num_pages

    @synchronized
    def group_page_counts(self, replica_idx: int) -> dict[str, tuple[int, int]]:
        """(free, total) pages of each cache group of one replica, by group name; with a
        shared budget (groups), total is the pages of the slots the group has now."""
        replica = self.replicas[replica_index(replica_idx, len(self.replicas))]
        budget = replica.budget
        return {
            g.name: (g.pool.num_free, g.pool.num_pages if budget is None else budget.present(i))
            for i, g in enumerate(replica.groups)
        }

    @synchronized
    def device_buffers(self, replica_idx: int, group: int = 0) -> list[Buffer]:
        """One replica's page buffers of one cache group (by index), one per device
        (`[pages, 2, layers, page_size, kv_heads_per_device, head_dim]`): what `fetch`
        hands the graph as `blocks`."""
        replica = self.replicas[replica_index(replica_idx, len(self.replicas))]
        return list(replica.groups[group].blocks)

    def device_scales(self, replica_idx: int, group: int = 0) -> list[Buffer] | None:
        """The scales beside `device_buffers` of scaled FP8 pages, one per device, under
        the same page ids (`fetch`'s `scales`); None for pages without scales."""
        replica = self.replicas[replica_index(replica_idx, len(self.replicas))]
        scales = replica.groups[group].scales
        return None if scales is None else list(scales)

    @property
    def free_blocks_pct(self) -> float:
        """Fraction (0.0-1.0) of all pages that are free or cached-free."""
        return self.num_free_blocks / self.total_num_pages

    @property
    def used_blocks_pct(self) -> float:
        """Fraction (0.0-1.0) of all pages owned by requests."""
        return 1.0 - self.free_blocks_pct

    @property
    @synchronized
    def metrics(self) -> KVCacheMetrics:
        return cache_metrics(self.replicas)

    @property
    def remote_metrics(self) -> RemoteMetrics:
        """`metrics.shared_tier_metrics`: the shared tier's own counters (not locked: the
        stores count from their own threads)."""
        return shared_tier_metrics(self.replicas)

    @property
    def total_num_host_pages(self) -> int:
        """Pages of the host-memory tier, all replicas (0 with the tier off)."""
        return self.metrics.host_total_pages

    @property
    def host_committed_block_pct(self) -> float:
        """Fraction (0.0-1.0) of host pages holding a committed prefix."""
        now = self.metrics
        total = now.host_total_pages
        return now.host_used_pages / total if total else 0.0

    @synchronized
    def reset_metrics(self) -> None:
        for r in self.replicas:
            r.reset_metrics()

    # --- MAX's multistep, data-parallel and sizing calls (multistep.py, sizing.py) ---

    @synchronized
    def increment_cache_lengths(
        self,
        kv_cache_inputs: Sequence[PagedInputs[Buffer, Buffer]],
        prev_model_inputs: Any,
    ) -> list[PagedInputs[Buffer, Buffer]]:
        """`multistep.increment_cache_lengths`: the next step's inputs, on the device."""
        return multistep.increment_cache_lengths(
            self._increment, self.params, len(self.replicas), kv_cache_inputs, prev_model_inputs
        )

    @synchronized
    def get_data_parallel_splits(self, context_batch: Sequence[TextGenerationContext]) -> Buffer:
        """int64 `[num_replicas + 1]`: offsets of each replica's requests in the batch,
        `[0, n_0, n_0 + n_1, ...]` (the batch must be ordered by replica)."""
        replicas = [self._replica_index(ctx.request_id) for ctx in context_batch]
        return multistep.data_parallel_splits(replicas, len(self.replicas))

    @classmethod
    def estimated_memory_size(
        cls,
        params: KVCacheParams,
        max_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        available_cache_memory: int,
        devices: Sequence[Device],
        **kwargs: Any,
    ) -> int:
        """`sizing.estimated_memory_size` (MAX's signature; `devices` is not read)."""
        return sizing.estimated_memory_size(
            params, max_batch_size, max_seq_len, num_layers, available_cache_memory
        )

    @classmethod
    def batch_size_for(
        cls, params: KVCacheParams, max_seq_len: int, num_layers: int, memory: int
    ) -> int:
        """`sizing.infer_optimal_batch_size` (MAX's classmethod, `infer_optimal_batch_size`,
        is the base class's)."""
        return sizing.infer_optimal_batch_size(params, max_seq_len, num_layers, memory)

    @classmethod
    def max_supported_sequence_length(
        cls, params: KVCacheParams, num_layers: int, memory_available: int
    ) -> int:
        """`sizing.max_supported_sequence_length`."""
        return sizing.max_supported_sequence_length(params, num_layers, memory_available)


def replica_index(replica_idx: int, num_replicas: int) -> int:
    """`replica_idx`, checked: InvalidReplicaError unless an int in [0, num_replicas)."""
    if replica_idx.__class__ is not int or not 0 <= replica_idx < num_replicas:
        raise InvalidReplicaError(
            f"replica_idx={replica_idx!r} is out of range for {num_replicas} replica(s)"
        )
    return replica_idx
