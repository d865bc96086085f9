"""NullKVCacheManager: the manager contract with no memory behind it.

Compile-only builds run on virtual devices (`max.driver.set_virtual_device_*`), where
no buffer can be used. This manager lets the same model code build its graph there:
it has the layout that `params.cache_strategy` names, returns that layout's graph input
types, and runtime inputs of the right dtypes and ranks that hold nothing (host
buffers of zero pages or slots).

It follows seed 001 (MAX 25.7's `NullKVCacheManager`): a compile-only pipeline drives
it without claiming, so no call asks for a claim. `get_replica` is 0 and
`get_req_blocks` empty for any request; `step` and `release` do nothing (`release` of a
request it never saw included); `maybe_reserve` is True and, as `external_claim`,
records the request, which `contains` reports until `release`. What it still refuses is
input no manager could take: ids that are not strings, a replica other than 0, windows
a step cannot process, steps past `max_seq_len`, batches past `max_batch_size`. Its
occupancy numbers are MAX's documented placeholders (1000 free blocks, 100% free).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.engine import InferenceSession

from ..config.params import KVCacheParams
from ..context import RequestID, TextGenerationContext
from ..errors import BatchTooLargeError, InvalidReplicaError
from ..layouts import layout_for
from ..metrics import KVCacheMetrics
from .base import (
    MaxManagerAPI,
    check_distinct,
    check_fits,
    check_num_steps,
    check_request_id,
    check_window,
    synchronized,
)


class NullKVCacheManager(MaxManagerAPI):
    """A no-op KV cache manager for compile-only mode on virtual devices."""

    def __init__(
        self,
        params: KVCacheParams,
        max_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
        session: InferenceSession,
        available_cache_memory: int,
        page_size: int = 128,
    ) -> None:
        super().__init__(
            params, layout_for(params), max_batch_size, max_seq_len, num_layers, devices, session
        )
        params.cache_groups(num_layers)  # groups whose layers do not add up: ValueError
        if params.recurrent is not None:
            raise ValueError(
                f"NullKVCacheManager gives no recurrent-state symbols (recurrent="
                f"{params.recurrent.name!r}): build the graph on MAX's "
                "`max_kv_params(params, ...).get_symbolic_inputs()`"
            )
        if page_size != 128 and page_size != params.page_size:
            raise ValueError(
                f"page_size={page_size} disagrees with params.page_size={params.page_size}; "
                "set it in KVCacheParams"
            )
        self.available_cache_memory = available_cache_memory
        self.page_size = params.page_size
        self._seen: set[RequestID] = set()  # claimed or reserved, not yet released
        self._metrics = KVCacheMetrics()

    @classmethod
    def estimated_memory_size(cls, *args: Any, **kwargs: Any) -> int:
        """Always 0: nothing is allocated."""
        return 0

    @synchronized
    def external_claim(self, request_id: RequestID, replica_idx: int | None = None) -> None:
        """Records the id (`contains`); claiming it again changes nothing, as in MAX."""
        check_request_id(request_id)
        if replica_idx is not None and (replica_idx.__class__ is not int or replica_idx != 0):
            raise InvalidReplicaError(f"replica_idx={replica_idx!r}: this manager has one replica")
        self._seen.add(request_id)

    @synchronized
    def contains(self, request_id: RequestID) -> bool:
        """Whether the request was claimed or reserved and not released since."""
        check_request_id(request_id)
        return request_id in self._seen

    @synchronized
    def release(self, request_id: RequestID) -> None:
        """Forgets the request, if it was known (nothing was held)."""
        check_request_id(request_id)
        self._seen.discard(request_id)

    @synchronized
    def maybe_reserve(self, data: TextGenerationContext, num_steps: int = 1) -> bool:
        """True for any request whose steps fit `max_seq_len` (nothing to hold), which it
        records as MAX's does."""
        check_num_steps(num_steps)
        check_request_id(data.request_id)
        check_window(data)
        check_fits(data, num_steps, self.max_seq_len)
        self._seen.add(data.request_id)
        return True

    @synchronized
    def step(self, batch: Sequence[TextGenerationContext]) -> None:
        """Records nothing (the request ids must be strings)."""
        for ctx in batch:
            check_request_id(ctx.request_id)

    @synchronized
    def fetch(self, batch: Sequence[TextGenerationContext], num_steps: int = 1) -> list[Any]:
        """One `layout.Inputs` per device, of the right dtypes and ranks, holding no memory."""
        check_num_steps(num_steps)
        if len(batch) > self.max_batch_size:
            raise BatchTooLargeError(
                f"batch of {len(batch)} requests is larger than "
                f"max_batch_size={self.max_batch_size}"
            )
        for ctx in batch:
            check_request_id(ctx.request_id)
            check_window(ctx)
            check_fits(ctx, num_steps, self.max_seq_len)
        check_distinct(batch)
        if self.params.groups:  # every group's in turn, as `input_symbols` names them
            params = self.params
            return [
                self.layout.empty_inputs(
                    params.group_params(g), g.num_layers, self.max_seq_len, len(batch), num_steps
                )
                for g in params.cache_groups(self.num_layers)
                for _ in self.devices
            ]
        return [
            self.layout.empty_inputs(
                self.params, self.num_layers, self.max_seq_len, len(batch), num_steps
            )
            for _ in self.devices
        ]

    @synchronized
    def increment_cache_lengths(self, kv_cache_inputs: Any, prev_model_inputs: Any) -> Any:
        """Returns `kv_cache_inputs` unchanged."""
        return kv_cache_inputs

    @synchronized
    def get_data_parallel_splits(self, batch: Sequence[TextGenerationContext]) -> Buffer:
        """int64 `[0, len(batch)]`: a single split holding every batch index."""
        return Buffer.from_numpy(np.array([0, len(batch)], dtype=np.int64))

    @synchronized
    def get_or_recommend_replica(self, context: TextGenerationContext) -> int:
        return 0

    @synchronized
    def get_replica(self, context: TextGenerationContext) -> int:
        """0, for any request (seed 001): the one replica."""
        check_request_id(context.request_id)
        return 0

    @synchronized
    def get_req_blocks(self, request_id: RequestID) -> list[int]:
        """Empty, for any request id, claimed or not (seed 001): no blocks are allocated."""
        check_request_id(request_id)
        return []

    @property
    @synchronized
    def num_free_blocks(self) -> int:
        """A dummy 1000."""
        return 1000

    @property
    @synchronized
    def free_blocks_pct(self) -> float:
        return 1.0

    @property
    @synchronized
    def used_blocks_pct(self) -> float:
        return 0.0

    @property
    @synchronized
    def metrics(self) -> KVCacheMetrics:
        return self._metrics

    @synchronized
    def reset_metrics(self) -> None:
        self._metrics = KVCacheMetrics()

    @synchronized
    def reset_prefix_cache(self) -> bool:
        """Nothing to forget: True."""
        return True
