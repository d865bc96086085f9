"""PagedKVCacheManager: fixed-size pages, prefix cache, data- and tensor-parallel replicas.

The request lifecycle (the manager contract of base.py, in MAX's spelling):

    external_claim(request_id, replica_idx)   # or claim(); binds the request to a replica
    maybe_reserve(ctx, num_steps) -> bool      # or alloc(), which raises instead of False
    fetch(batch, num_steps) -> inputs          # or get_runtime_inputs(); feeds the graph
    ... run the model, ctx.update(token) ...
    step(batch)                                # commits pages that became full
    release(request_id)

Memory: `available_cache_memory` is split evenly between the `data_parallel_degree`
replicas; each replica holds `floor(memory_per_replica / bytes_per_page)` pages, where
`bytes_per_page = page_size * 2 * num_layers * n_kv_heads * head_dim * dtype size`.
A replica's pages live in one `max.driver.Buffer` per device, each device holding
`n_kv_heads_per_device` of the heads (layout in `mokv.inputs`).

Host tier (`params.enable_kvcache_swapping_to_host`): each replica also holds
`floor(host_kvcache_swap_space_gb * 2**30 / data_parallel_degree / bytes_per_page)` host
pages (one host buffer per device shard); see `paged_replica.py` and README "Host tier".

Shared tier (`params.remote_kvcache_url`): each replica opens one `RemotePageStore` per
device shard on the Redis server; `close` flushes and closes them, and
`remote_metrics` sums their counters (README "Shared tier").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.engine import InferenceSession

from ..cache.hashing import page_hash_fn, root_hash
from ..context import RequestID, TextGenerationContext
from ..errors import (
    AlreadyClaimedError,
    BatchTooLargeError,
    InsufficientMemoryError,
    InsufficientPagesError,
    InvalidReplicaError,
    UnknownRequestError,
)
from ..events.config import KVEventsConfig
from ..events.format import MEDIUM_CPU
from ..events.publisher import open_publishers, resolve_events_config
from ..layouts import PAGED, RaggedKVCacheInputs
from ..metrics import KVCacheMetrics
from ..params import KVCacheParams
from ..remote import RemoteMetrics
from .base import ManagerFields, check_num_steps, check_request_id, synchronized
from .compat import MaxManagerAPI
from .increment import CacheLengthIncrementer, check_batch_size, row_offsets_per_device
from .paged_replica import PagedReplica, Reservation, _ceil_div


class PagedKVCacheManager(MaxManagerAPI, ManagerFields):
    """Paged KV cache manager with data and tensor parallelism support.

    Args:
        params: cache shape and features (see `KVCacheParams`).
        max_batch_size: most requests held at once, over all replicas together.
        max_seq_len: most tokens one request may hold.
        num_layers: transformer layers; each page holds K and V of every layer.
        devices: `params.n_devices` devices; replica `r` owns
            `devices[r * tp : (r + 1) * tp]` with `tp = params.tensor_parallel_degree`.
        session: the InferenceSession that runs the model (and the small graph of
            `increment_cache_lengths`).
        available_cache_memory: bytes for KV pages over all devices.
        zmq_endpoint_base: publish KV-cache events (vLLM's format) on this ZMQ
            address, replica r on its offset (`KVEventsConfig(endpoint=...)`).
        kv_events_config: the fuller events configuration (replay socket, topic,
            payload form, limits); None with no `zmq_endpoint_base`: no events.
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
        events_config = resolve_events_config(zmq_endpoint_base, kv_events_config, params)
        dp = params.data_parallel_degree
        num_pages = self._pages_per_replica(params, num_layers, available_cache_memory)
        pages_per_seq = _ceil_div(max_seq_len, params.page_size)
        if num_pages < pages_per_seq:
            raise InsufficientMemoryError(
                f"available_cache_memory={available_cache_memory} bytes gives {num_pages} "
                f"page(s) per replica; one sequence of max_seq_len={max_seq_len} needs "
                f"{pages_per_seq} (at {params.bytes_per_page(num_layers)} bytes per page)"
            )
        if max_batch_size < dp:
            raise ValueError(
                f"max_batch_size={max_batch_size} is smaller than data_parallel_degree={dp}"
            )
        num_host_pages = self._host_pages_per_replica(params, num_layers)
        hash_fn = page_hash_fn(params.prefix_hash)
        root = root_hash(params.prefix_hash, params.prefix_hash_seed)
        tp = params.tensor_parallel_degree
        self.replicas = [
            PagedReplica(
                params,
                num_pages,
                _ceil_div(max_batch_size, dp),
                max_seq_len,
                num_layers,
                list(self.devices[r * tp : (r + 1) * tp]),
                hash_fn,
                root,
                num_host_pages,
            )
            for r in range(dp)
        ]
        # One publisher per replica (its own PUB socket), opened last so that nothing
        # after it can fail; the replica's page pool tells it what changed.
        self.kv_event_publishers = open_publishers(
            events_config, params.page_size, [self.devices[r * tp] for r in range(dp)]
        )
        for replica, publisher in zip(self.replicas, self.kv_event_publishers):
            replica.pool.events = publisher
            if replica.host is not None:
                replica.host.events = publisher.medium_sink(MEDIUM_CPU)
        self.page_size = params.page_size
        self.total_num_pages = num_pages * dp
        self.enable_runtime_checks = enable_runtime_checks
        self._replica_of: dict[RequestID, int] = {}
        self._increment = CacheLengthIncrementer(session, with_max_lengths=True)

    # --- sizing ---------------------------------------------------------------------

    @staticmethod
    def _pages_per_replica(params: KVCacheParams, num_layers: int, memory: int) -> int:
        """`floor(memory / data_parallel_degree / bytes_per_page(num_layers))`."""
        per_replica = memory // params.data_parallel_degree
        return per_replica // params.bytes_per_page(num_layers)

    @staticmethod
    def _host_pages_per_replica(params: KVCacheParams, num_layers: int) -> int:
        """Host-tier pages of one replica: 0 with the tier off."""
        if not params.enable_kvcache_swapping_to_host:
            return 0
        host_bytes = int(params.host_kvcache_swap_space_gb * 2**30)  # type: ignore[operator]
        num = host_bytes // params.data_parallel_degree // params.bytes_per_page(num_layers)
        if num < 1:
            raise InsufficientMemoryError(
                f"host_kvcache_swap_space_gb={params.host_kvcache_swap_space_gb} holds no "
                f"page of {params.bytes_per_page(num_layers)} bytes per replica"
            )
        return num

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
        """Bytes the manager allocates for these arguments.

        `data_parallel_degree * floor(available_cache_memory / data_parallel_degree /
        bytes_per_page) * bytes_per_page`: the budget, rounded down to whole pages.
        """
        pages = cls._pages_per_replica(params, num_layers, available_cache_memory)
        return params.data_parallel_degree * pages * params.bytes_per_page(num_layers)

    @classmethod
    def infer_optimal_batch_size(
        cls,
        params: KVCacheParams,
        max_seq_len: int,
        num_layers: int,
        available_cache_memory: int,
        devices: Sequence[Device],
        **kwargs: Any,
    ) -> int:
        """Most requests of `max_seq_len` tokens that fit at once, at least 1.

        `max(1, data_parallel_degree * floor(pages_per_replica / ceil(max_seq_len / page_size)))`.
        """
        pages = cls._pages_per_replica(params, num_layers, available_cache_memory)
        per_seq = _ceil_div(max_seq_len, params.page_size)
        return max(1, params.data_parallel_degree * (pages // per_seq))

    @classmethod
    def max_supported_sequence_length(
        cls, params: KVCacheParams, num_layers: int, memory_available: int
    ) -> int:
        """Longest sequence every replica can hold: `pages_per_replica * page_size`.

        Replicas get equal shares of `memory_available`, so the minimum over replicas is
        the value of any one of them; it is a multiple of `page_size`.
        """
        return cls._pages_per_replica(params, num_layers, memory_available) * params.page_size

    # --- requests -------------------------------------------------------------------

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
    def external_claim(self, request_id: RequestID, replica_idx: int | None = None) -> None:
        """Binds `request_id` to a replica (by default the one with the most free pages)."""
        check_request_id(request_id)
        if replica_idx is None:
            replica_idx = (
                0 if self.num_replicas == 1
                else max(range(self.num_replicas), key=lambda r: self.replicas[r].pool.num_free)
            )
        if replica_idx.__class__ is not int or not 0 <= replica_idx < self.num_replicas:
            raise InvalidReplicaError(
                f"replica_idx={replica_idx!r} is out of range for {self.num_replicas} replica(s)"
            )
        if request_id in self._replica_of:
            raise AlreadyClaimedError(request_id)
        self.replicas[replica_idx].claim(request_id)
        self._replica_of[request_id] = replica_idx
        self._after_change()

    @synchronized
    def release(self, request_id: RequestID) -> None:
        """Frees the request's pages (hashed ones stay reusable) and forgets it."""
        self._replica(request_id).release(request_id)
        del self._replica_of[request_id]
        self._after_change()

    @synchronized
    def get_replica(self, context: TextGenerationContext) -> int:
        return self._replica_index(context.request_id)

    @synchronized
    def get_or_recommend_replica(self, context: TextGenerationContext) -> int:
        """The request's replica if claimed; else the one with the longest cached prefix
        of its tokens, ties going to the one with the most free pages."""
        if context.request_id in self._replica_of:
            return self._replica_of[context.request_id]
        return max(
            range(self.num_replicas),
            key=lambda r: (
                self.replicas[r].num_prefix_hit_pages(context),
                self.replicas[r].pool.num_free,
            ),
        )

    @synchronized
    def get_req_blocks(self, request_id: RequestID) -> list[int]:
        """Page ids the request holds, in token order."""
        return self._replica(request_id).pages_of(request_id)

    # --- steps ----------------------------------------------------------------------

    def maybe_reserve(self, data: TextGenerationContext, num_steps: int = 1) -> bool:
        """Holds the pages `data` needs for `num_steps` steps, reusing its cached prefix.

        Returns False, changing nothing, when they do not fit; after True, `fetch` for
        the same steps cannot run out of pages. On a prefix hit the context moves its
        window past the reused tokens (`data.skip_cached_prefix`).
        """
        # The lock is taken here rather than by @synchronized: this is the one call made
        # per request per step, and the wrapper's extra frame measured ~0.15 µs of it.
        self._lock.acquire()
        try:
            check_num_steps(num_steps)
            replica = self._replica(data.request_id)
            plan = replica.plan(data, num_steps)
            if plan is None:
                return True
            if not replica.fits([plan]):
                return False
            replica.apply([plan])
            self._after_change()
            return True
        finally:
            self._lock.release()

    @synchronized
    def fetch(
        self, batch: Sequence[TextGenerationContext], num_steps: int = 1
    ) -> list[RaggedKVCacheInputs[Buffer, Buffer]]:
        """Graph inputs for `batch`, one `RaggedKVCacheInputs` per device.

        The batch must be ordered by replica (as `get_data_parallel_splits` expects);
        devices come replica by replica. Requests not yet reserved are reserved here.
        All or nothing: every request is checked and every reservation planned before
        anything changes; `InsufficientPagesError` (and no change) if the pages of the
        batch do not fit.
        """
        check_num_steps(num_steps)
        if len(batch) > self.max_batch_size:
            raise BatchTooLargeError(
                f"batch of {len(batch)} requests is larger than max_batch_size={self.max_batch_size}"
            )
        groups: list[list[TextGenerationContext]] = [[] for _ in self.replicas]
        plans: list[list[Reservation]] = [[] for _ in self.replicas]
        last = 0
        for ctx in batch:
            r = self._replica_index(ctx.request_id)
            if r < last:
                raise ValueError(
                    f"batch is not ordered by replica: {ctx.request_id!r} (replica {r}) "
                    f"comes after a request of replica {last}"
                )
            last = r
            groups[r].append(ctx)
            plan = self.replicas[r].plan(ctx, num_steps)
            if plan is not None:
                plans[r].append(plan)
        if len({ctx.request_id for ctx in batch}) != len(batch):
            raise ValueError("a request appears twice in the batch")
        for replica, replica_plans in zip(self.replicas, plans):
            if replica_plans and not replica.fits(replica_plans):
                raise InsufficientPagesError(
                    f"the batch needs more pages than the {replica.pool.num_free} free; "
                    "call maybe_reserve before fetch"
                )
        for replica, replica_plans in zip(self.replicas, plans):
            if replica_plans:
                replica.apply(replica_plans)
        for replica, group in zip(self.replicas, groups):
            if replica.host is not None or replica.remote:
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

        Every request is checked before any page is committed.
        """
        groups: list[list[TextGenerationContext]] = [[] for _ in self.replicas]
        for ctx in batch:
            groups[self._replica_index(ctx.request_id)].append(ctx)
        if len({ctx.request_id for ctx in batch}) != len(batch):
            raise ValueError("a request appears twice in the batch")
        plans = [replica.plan_commit(group) for replica, group in zip(self.replicas, groups)]
        for replica, plan in zip(self.replicas, plans):
            replica.commit(plan)
        for publisher in self.kv_event_publishers:  # one event batch per step
            publisher.end_step()
        self._after_change()

    @synchronized
    def increment_cache_lengths(
        self,
        kv_cache_inputs: Sequence[RaggedKVCacheInputs[Buffer, Buffer]],
        prev_model_inputs: Any,
    ) -> list[RaggedKVCacheInputs[Buffer, Buffer]]:
        """Inputs for the next step of multistep decoding, computed on the device.

        `prev_model_inputs.input_row_offsets` (or the offsets themselves) gives the rows
        each request processed: one Buffer for a single replica, else one per replica or
        per device. Cache lengths grow by those counts and `max_lengths` drops a row.
        """
        offsets = row_offsets_per_device(
            prev_model_inputs, self.num_replicas, self.params.tensor_parallel_degree
        )
        if len(kv_cache_inputs) != len(offsets):
            raise ValueError(f"got {len(kv_cache_inputs)} cache inputs for {len(offsets)} devices")
        for inputs, row_offsets in zip(kv_cache_inputs, offsets):
            check_batch_size(inputs.cache_lengths, row_offsets)
        out = []
        for inputs, row_offsets in zip(kv_cache_inputs, offsets, strict=True):
            cache_lengths, max_lengths = self._increment(
                inputs.cache_lengths, row_offsets, inputs.max_lengths
            )
            out.append(inputs._replace(cache_lengths=cache_lengths, max_lengths=max_lengths))
        return out

    @synchronized
    def get_data_parallel_splits(self, context_batch: Sequence[TextGenerationContext]) -> Buffer:
        """int64 `[num_replicas + 1]`: offsets of each replica's requests in the batch,
        `[0, n_0, n_0 + n_1, ...]` (the batch must be ordered by replica)."""
        counts = np.zeros(self.num_replicas + 1, dtype=np.int64)
        for ctx in context_batch:
            counts[self._replica_index(ctx.request_id) + 1] += 1
        return Buffer.from_numpy(np.cumsum(counts))

    # --- occupancy and metrics ------------------------------------------------------

    @property
    @synchronized
    def num_free_blocks(self) -> int:
        """Pages that can be handed out now (cached-free pages included), all replicas."""
        return sum(r.pool.num_free for r in self.replicas)

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
        hosts = [r.host_pages for r in self.replicas if r.host_pages is not None]
        return KVCacheMetrics(
            input_tokens=sum(r.input_tokens for r in self.replicas),
            cache_tokens=sum(r.cache_tokens for r in self.replicas),
            used_pages=sum(r.pool.num_used for r in self.replicas),
            free_pages=self.num_free_blocks,
            host_cache_tokens=sum(r.host_cache_tokens for r in self.replicas),
            host_used_pages=sum(r.host.num_cached for r in self.replicas if r.host),
            host_total_pages=self.total_num_host_pages,
            bytes_to_host=sum(h.bytes_to_host for h in hosts),
            bytes_from_host=sum(h.bytes_from_host for h in hosts),
            remote_cache_tokens=sum(r.remote_cache_tokens for r in self.replicas),
            bytes_from_remote=sum(r.bytes_from_remote for r in self.replicas),
        )

    @property
    def remote_metrics(self) -> RemoteMetrics:
        """The shared tier's own counters, summed over every store (one per device shard
        per replica, so with tensor parallelism each page counts once per shard): hits,
        misses, rejected values, bytes each way, errors, timeouts, drops. All zero with
        the tier off. The stores count from their own threads, so this is not locked."""
        total = RemoteMetrics()
        for store in (s for r in self.replicas for s in r.remote):
            for name, value in store.metrics.as_dict().items():
                setattr(total, name, getattr(total, name) + value)
        return total

    @property
    def total_num_host_pages(self) -> int:
        """Pages of the host-memory tier, all replicas (0 with the tier off)."""
        return sum(r.host.num_pages for r in self.replicas if r.host is not None)

    @property
    @synchronized
    def host_committed_block_pct(self) -> float:
        """Fraction (0.0-1.0) of host pages holding a committed prefix."""
        total = self.total_num_host_pages
        used = sum(r.host.num_cached for r in self.replicas if r.host is not None)
        return used / total if total else 0.0

    @synchronized
    def reset_metrics(self) -> None:
        for r in self.replicas:
            r.input_tokens = r.cache_tokens = r.host_cache_tokens = 0
            r.remote_cache_tokens = r.bytes_from_remote = 0
            if r.host_pages is not None:
                r.host_pages.bytes_to_host = r.host_pages.bytes_from_host = 0

    @synchronized
    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix; pages owned by requests stay theirs."""
        for r in self.replicas:
            r.reset_prefix_cache()
        for publisher in self.kv_event_publishers:
            publisher.end_step()
        self._after_change()

    @synchronized
    def close(self) -> None:
        """Publishes the events still queued and closes the event sockets (if any); sends
        the pages queued for the shared tier (a bounded wait) and disconnects from it."""
        for publisher in self.kv_event_publishers:
            publisher.close()
        for replica in self.replicas:
            replica.close_remote()

    @synchronized
    def check_invariants(self) -> None:
        """Raises InvariantError if any replica's bookkeeping is inconsistent."""
        for r in self.replicas:
            r.check_invariants()

    def _after_change(self) -> None:
        if self.enable_runtime_checks:
            self.check_invariants()
