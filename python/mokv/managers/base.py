"""The KV cache manager contract, and the constructor arguments every manager shares.

A scheduler, a model runner or a benchmark uses a manager only through `KVCacheManager`:

    manager.external_claim(ctx.request_id)          # once per request
    if manager.maybe_reserve(ctx, num_steps):       # False: no room now, nothing changed
        inputs = manager.fetch(batch, num_steps)    # one layout.Inputs of Buffers per device
        ... run the graph built on manager.input_symbols(), ctx.update(token) ...
        manager.step(batch)                         # record what the step wrote
    manager.release(ctx.request_id)

MAX's other spellings of the same operations (`claim`, `alloc`, `get_runtime_inputs`,
`get_symbolic_inputs`) are `MaxManagerAPI`, the base of the managers that take MAX's
calls; MAX's sequence-id flow of the continuous cache is its own class,
`ContinuousBatchingKVCacheManager` (sequences.py), and MAX's flat configuration
spellings are mapped in `mokv.config.flat`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
from max.driver import Device
from max.engine import InferenceSession
from max.graph import DeviceRef

from ..config.params import KVCacheParams
from ..context import RequestID, TextGenerationContext
from ..errors import InsufficientPagesError, SequenceTooLongError
from ..layouts import CacheLayout
from ..layouts.paged import group_input_symbols
from ..metrics import KVCacheMetrics
from ..undo import UndoLog


@runtime_checkable
class KVCacheManager(Protocol):
    """What every mokv manager (paged, continuous, null) promises its callers.

    Errors: a caller's mistake raises a typed `MokvError` naming the bad value and
    changes nothing; "no room now" is `maybe_reserve` returning False, never an error.
    """

    params: KVCacheParams
    """The cache's shape and features."""
    layout: CacheLayout
    """What `fetch` returns and `input_symbols` describes (paged or continuous)."""
    devices: list[Device]
    """The devices holding the cache, one `fetch` tuple each."""
    max_batch_size: int
    """Most requests held at once (all replicas together)."""
    max_seq_len: int
    """Most tokens one request may hold."""

    def external_claim(self, request_id: RequestID, replica_idx: int | None = None) -> None:
        """Starts tracking a request (AlreadyClaimedError, BatchTooLargeError when full)."""
        ...

    def contains(self, request_id: RequestID) -> bool:
        """Whether the request is claimed and not yet released."""
        ...

    def maybe_reserve(self, data: TextGenerationContext, num_steps: int = 1) -> bool:
        """Holds what `data` needs for `num_steps` steps; False changes nothing, and after
        True the matching `fetch` cannot run out of memory."""
        ...

    def fetch(self, batch: Sequence[TextGenerationContext], num_steps: int = 1) -> list[Any]:
        """One `layout.Inputs` of Buffers per device describing `batch` to the graph."""
        ...

    def step(self, batch: Sequence[TextGenerationContext]) -> None:
        """Records the tokens the batch's last step wrote (call after `ctx.update`)."""
        ...

    def release(self, request_id: RequestID) -> None:
        """Stops tracking a request and frees its memory (cached pages stay reusable)."""
        ...

    def input_symbols(
        self, devices: Sequence[Device] | None = None, num_layers: int | None = None
    ) -> list[Any]:
        """One `layout.Inputs` of graph types per device, matching `fetch`."""
        ...

    @property
    def num_free_blocks(self) -> int:
        """Pages (continuous: slots) that can be handed out now."""
        ...

    @property
    def metrics(self) -> KVCacheMetrics:
        """Token and occupancy counters."""
        ...


def check_request_id(request_id: object) -> None:
    """TypeError unless `request_id` is a string (a `RequestID`)."""
    if not isinstance(request_id, str):
        hint = (
            "; sequence ids (ints) are ContinuousBatchingKVCacheManager's"
            if isinstance(request_id, int)
            else ""
        )
        raise TypeError(
            f"request_id must be a str (mokv.RequestID), got {type(request_id).__name__} "
            f"{request_id!r}{hint}"
        )


MAX_UINT32 = 2**32 - 1
"""Largest batch size, sequence length or layer count: MAX's graph inputs carry cache
lengths, page ids and layer indices as uint32."""


def check_positive(**values: int) -> None:
    """ValueError naming the first value that is not an int in [1, `MAX_UINT32`]."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_UINT32:
            raise ValueError(f"{name} must be a positive int up to 2**32 - 1, got {value!r}")


def refuse_paged_features(params: KVCacheParams, manager: str) -> None:
    """ValueError naming the setting when `params` asks for what only the paged manager
    does: tiers below the device pages, or KV-cache events (both are about committed
    prefix pages, which a continuous cache never has), or cache groups. Never silently
    ignored."""
    if params.tiers:
        raise ValueError(
            f"{manager} keeps no prefix pages, so it cannot honour tiers={params.tiers!r} "
            "(host and shared tiers hold committed prefix pages): use the paged manager "
            "or drop the tiers"
        )
    if params.kv_events is not None:
        raise ValueError(
            f"{manager} has no prefix cache to publish events of, so it cannot honour "
            f"kv_events={params.kv_events!r}: use the paged manager or drop the events"
        )
    if params.groups:
        raise ValueError(
            f"{manager} holds one slot of every layer per request, so it cannot honour "
            f"groups={[g.name for g in params.groups]} (a sliding window's pages are "
            "released as it slides; an MLA group's pages hold latents): use the paged manager"
        )
    if params.recurrent is not None:
        raise ValueError(
            f"{manager} cannot honour recurrent={params.recurrent.name!r} (state "
            "checkpoints are found by prefix hashes): use the paged manager"
        )


def check_window(ctx: TextGenerationContext) -> None:
    """ValueError naming the request unless its window is one a step can process:
    `0 <= start_idx < active_idx <= end_idx` (a context's own methods keep it so; a
    hand-made context may not)."""
    start, active, end = ctx.start_idx, ctx.active_idx, ctx.end_idx
    if not 0 <= start < active <= end:
        raise ValueError(
            f"request {ctx.request_id!r} has start_idx={start!r}, active_idx={active!r}, "
            f"end_idx={end!r}: a step needs 0 <= start_idx < active_idx <= end_idx"
        )


def integer_tokens(ctx: TextGenerationContext) -> np.ndarray:
    """`ctx.tokens` as an array; TypeError naming the request unless they are integer
    ids (floats hashed as int64 would match the pages of the integers they truncate to;
    `TextContext` refuses them itself, a hand-made context may not)."""
    tokens = np.asarray(ctx.tokens)
    if tokens.dtype.kind not in "iu":
        raise TypeError(
            f"request {ctx.request_id!r} has tokens of dtype {tokens.dtype}: token ids are integers"
        )
    return tokens


def check_fits(ctx: TextGenerationContext, num_steps: int, max_seq_len: int) -> None:
    """SequenceTooLongError unless `ctx`'s window and `num_steps` steps fit `max_seq_len`."""
    needed = ctx.active_idx + num_steps - 1
    if needed > max_seq_len:
        raise sequence_too_long(ctx.request_id, needed, num_steps, max_seq_len)


def sequence_too_long(
    request_id: object, needed: int, num_steps: int, max_seq_len: int
) -> SequenceTooLongError:
    """The error of a request whose steps would pass `max_seq_len` (every manager's)."""
    return SequenceTooLongError(
        f"request {request_id!r} needs {needed} tokens of cache for {num_steps} step(s), "
        f"past max_seq_len={max_seq_len}"
    )


def check_distinct(batch: Sequence[TextGenerationContext]) -> None:
    """ValueError naming the request that appears twice in `batch`."""
    seen: set[RequestID] = set()
    for ctx in batch:
        if ctx.request_id in seen:
            raise ValueError(f"request {ctx.request_id!r} appears twice in the batch")
        seen.add(ctx.request_id)


def check_num_steps(num_steps: int) -> None:
    """ValueError unless `num_steps` is a positive int (runs on every step: kept cheap)."""
    if num_steps.__class__ is not int or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")


Method = TypeVar("Method", bound=Callable[..., Any])


def synchronized(method: Method) -> Method:
    """Runs `method` under the manager's lock (`self._lock`, re-entrant).

    One lock per manager around each public call: a caller may use a manager from
    several threads (a scheduler thread, a thread publishing events or copying pages).
    Measured uncontended cost: see the benchmark (`benchmarks/README.md`).
    """

    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        lock = self._lock
        lock.acquire()  # not `with`: its __enter__/__exit__ lookups cost more
        try:
            return method(self, *args, **kwargs)
        finally:
            lock.release()

    return locked  # type: ignore[return-value]


def atomic(method: Method) -> Method:
    """`synchronized`, and all or nothing: whatever the call changed is undone when it
    raises anything (`UndoLog.run`'s bracket, see `mokv.undo`).

    The bracket is spelled out (`begin`, `rollback`, `end`) rather than passed through
    `self._undo.run`, which would pack the call's arguments once more: ~0.1 µs of each
    claim and release, and a scheduler claims and releases a waiting prompt that does
    not fit at nearly every step."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        lock = self._lock
        lock.acquire()  # not `with`, as `synchronized`
        try:
            undo = self._undo
            mark = undo.begin()
            try:
                return method(self, *args, **kwargs)
            except BaseException:
                undo.rollback(mark)
                raise
            finally:
                undo.end()
        finally:
            lock.release()

    return run  # type: ignore[return-value]


class ManagerFields:
    """The constructor arguments every manager shares, checked, and its layout."""

    def __init__(
        self,
        params: KVCacheParams,
        layout: CacheLayout,
        max_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
        session: InferenceSession,
    ) -> None:
        if not isinstance(params, KVCacheParams):
            raise TypeError(f"params must be a mokv.KVCacheParams, got {type(params).__name__}")
        check_positive(
            max_batch_size=max_batch_size, max_seq_len=max_seq_len, num_layers=num_layers
        )
        if not isinstance(session, InferenceSession):
            raise TypeError(
                f"session must be a max.engine.InferenceSession, got {type(session).__name__}"
            )
        devices = list(devices)
        bad = [d for d in devices if not isinstance(d, Device)]
        if bad:
            raise TypeError(f"devices must be max.driver.Device objects, got {bad[0]!r}")
        if len(devices) != params.n_devices:
            raise ValueError(
                f"got {len(devices)} device(s) but params.n_devices={params.n_devices}"
            )
        self.params = params
        self.layout = layout
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.num_layers = num_layers
        self.devices = devices
        self.session = session
        self._lock = threading.RLock()
        self._undo = UndoLog()

    def input_symbols(
        self, devices: Sequence[Device] | None = None, num_layers: int | None = None
    ) -> list[Any]:
        """One `layout.Inputs` of graph types per device, matching `fetch`. With several
        data-parallel replicas, device `i` belongs to replica `i // tensor_parallel_degree`
        and its per-batch dims are that replica's own (`replica_<r>_batch_size`, as in
        MAX), so that one graph takes replicas' batches of different sizes. A cache of
        groups (`params.groups`) has every group's in turn, each with its own layers
        (`mokv.layouts.paged.group_input_symbols`)."""
        if self.params.groups:
            if num_layers is not None and num_layers != self.num_layers:
                raise ValueError(
                    f"num_layers={num_layers}: a cache of groups has its layers per group "
                    f"({self.num_layers} in all)"
                )
            refs = [DeviceRef.from_device(d) for d in devices or self.devices]
            return group_input_symbols(self.params, self.num_layers, self.max_seq_len, refs)
        dp, tp = self.params.data_parallel_degree, self.params.tensor_parallel_degree
        return [
            self.layout.input_symbols(
                self.params,
                num_layers or self.num_layers,
                self.max_seq_len,
                DeviceRef.from_device(d),
                dim_prefix=f"replica_{i // tp}_" if dp > 1 else "",
            )
            for i, d in enumerate(devices or self.devices)
        ]


class MaxManagerAPI(ManagerFields):
    """`ManagerFields`, and the MAX names of `external_claim`, `maybe_reserve`, `fetch` and
    `input_symbols` and the host-tier counters (0 for a manager without a host tier):
    MAX renamed parts of its manager interface between releases, and mokv answers to
    both. Each is a thin alias of a `KVCacheManager` member, so a manager implements
    the contract and gets these for free."""

    def claim(self: KVCacheManager, request_id: RequestID, replica_idx: int | None = None) -> Any:
        """Same as `external_claim`."""
        return self.external_claim(request_id, replica_idx)

    def alloc(self: KVCacheManager, data: TextGenerationContext, num_steps: int = 1) -> None:
        """`maybe_reserve`, raising `InsufficientPagesError` instead of returning False."""
        if not self.maybe_reserve(data, num_steps):
            raise InsufficientPagesError(
                f"not enough free pages to hold request {data.request_id!r} for {num_steps} step(s)"
            )

    def get_runtime_inputs(
        self: KVCacheManager, batch: Sequence[TextGenerationContext], num_steps: int = 1
    ) -> list[Any]:
        """Same as `fetch`."""
        return self.fetch(batch, num_steps)

    def get_symbolic_inputs(
        self: KVCacheManager, devices: Sequence[Device] | None = None, num_layers: int | None = None
    ) -> list[Any]:
        """Same as `input_symbols`."""
        return self.input_symbols(devices, num_layers)

    def max_input_symbols(
        self: KVCacheManager, devices: Sequence[Device] | None = None, num_layers: int | None = None
    ) -> list[Any]:
        """`input_symbols` in the form MAX's own paged graph ops take: one
        `max.nn.kv_cache.KVCacheInputsPerDevice` of graph types per device (its
        `max.tree.leaves` are the graph's cache inputs; `mokv.max_cache_values` turns
        those values back into MAX's `PagedCacheValues`). Paged caches only."""
        from ..layouts.max_paged import max_input_symbols

        _check_paged(self)
        symbols = self.input_symbols(devices, num_layers)
        kinds = _input_groups(self, len(symbols))
        return [max_input_symbols(s, kind == "mla") for s, (kind, _) in zip(symbols, kinds)]

    def max_inputs(
        self: KVCacheManager, fetched: Sequence[Any], mla_q_heads: int | None = None
    ) -> list[Any]:
        """A `fetch` result in the form MAX's own paged graph ops take, to match
        `max_input_symbols` (the same cache buffers, plus host scalars; nothing is read
        back from a device; a cache of groups: every group's in turn). An MLA cache's
        dispatch metadata needs the query heads of a device (`mla_q_heads`, MAX's
        `num_q_heads_per_device`). Paged caches only."""
        from ..layouts.max_paged import max_runtime_inputs

        _check_paged(self)
        kinds = _input_groups(self, len(fetched))
        if mla_q_heads is None and any(kind == "mla" for kind, _ in kinds):
            raise ValueError(
                "max_inputs of an MLA cache needs mla_q_heads (the query heads of a device)"
            )
        return [
            max_runtime_inputs(inputs, heads, mla_q_heads=mla_q_heads if kind == "mla" else None)
            for inputs, (kind, heads) in zip(fetched, kinds)
        ]

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
        """MAX's classmethod: the most requests of `max_seq_len` tokens that fit
        `available_cache_memory` at once, at least 1 (`batch_size_for`; `devices` and the
        rest are not read)."""
        return cls.batch_size_for(params, max_seq_len, num_layers, available_cache_memory)

    @classmethod
    def batch_size_for(
        cls, params: KVCacheParams, max_seq_len: int, num_layers: int, memory: int
    ) -> int:
        """The manager's own answer to `infer_optimal_batch_size`: 1 unless it overrides."""
        return 1

    @property
    def total_num_host_pages(self) -> int:
        """Pages of the host-memory tier: 0 (the paged manager overrides this)."""
        return 0

    @property
    def host_committed_block_pct(self) -> float:
        """Fraction of host pages holding committed prefixes: 0.0 (no host tier)."""
        return 0.0


def _check_paged(manager: KVCacheManager) -> None:
    """TypeError unless the manager's cache is paged (MAX 26.7's graph ops have no
    continuous-batching attention)."""
    if manager.layout.name != "paged":
        raise TypeError(
            f"MAX's graph ops take a paged cache; this manager's layout is {manager.layout.name!r}"
        )


def _input_groups(manager: Any, count: int) -> list[tuple[str, int]]:
    """(group kind, KV heads per device) of each of `count` per-device inputs of
    `manager`, every group's in turn."""
    params = manager.params
    groups = params.cache_groups(manager.num_layers)
    return [
        (group.kind, params.group_params(group).n_kv_heads_per_device)
        for group in groups
        for _ in range(count // len(groups))
    ]
