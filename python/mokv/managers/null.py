"""NullKVCacheManager: the manager contract with no memory behind it.

Compile-only builds run on virtual devices (`max.driver.set_virtual_device_*`), where
no buffer can be used. This manager lets the same model code build its graph there:
it has the layout that `params.cache_strategy` names, returns that layout's graph input
types, and runtime inputs of the right dtypes and ranks that hold nothing (host
buffers of zero pages or slots). It tracks claims like a real manager, so a model
that misuses the manager fails in compile-only mode the way it would for real (MAX's
null manager accepts any id there); its occupancy numbers are MAX's documented
placeholders (1000 free blocks, 100% free), and `get_req_blocks` is empty for any id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.engine import InferenceSession

from ..config.params import KVCacheParams
from ..context import RequestID, TextGenerationContext
from ..errors import (
    AlreadyClaimedError,
    BatchTooLargeError,
    InvalidReplicaError,
    UnknownRequestError,
)
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
        if page_size != 128 and page_size != params.page_size:
            raise ValueError(
                f"page_size={page_size} disagrees with params.page_size={params.page_size}; "
                "set it in KVCacheParams"
            )
        self.available_cache_memory = available_cache_memory
        self.page_size = params.page_size
        self._claimed: set[RequestID] = set()
        self._metrics = KVCacheMetrics()

    @classmethod
    def estimated_memory_size(cls, *args: Any, **kwargs: Any) -> int:
        """Always 0: nothing is allocated."""
        return 0

    def _check_claimed(self, request_id: RequestID) -> None:
        check_request_id(request_id)
        if request_id not in self._claimed:
            raise UnknownRequestError(request_id)

    @synchronized
    def external_claim(self, request_id: RequestID, replica_idx: int | None = None) -> None:
        """Records the id, so that `contains` and later calls answer as a real manager's."""
        check_request_id(request_id)
        if replica_idx is not None and (replica_idx.__class__ is not int or replica_idx != 0):
            raise InvalidReplicaError(f"replica_idx={replica_idx!r}: this manager has one replica")
        if request_id in self._claimed:
            raise AlreadyClaimedError(request_id)
        if len(self._claimed) >= self.max_batch_size:
            raise BatchTooLargeError(
                f"cannot claim {request_id!r}: {self.max_batch_size} requests are claimed "
                "(max_batch_size)"
            )
        self._claimed.add(request_id)

    @synchronized
    def contains(self, request_id: RequestID) -> bool:
        check_request_id(request_id)
        return request_id in self._claimed

    @synchronized
    def release(self, request_id: RequestID) -> None:
        self._check_claimed(request_id)
        self._claimed.discard(request_id)

    @synchronized
    def maybe_reserve(self, data: TextGenerationContext, num_steps: int = 1) -> bool:
        """True for a claimed request whose steps fit `max_seq_len`: nothing to hold."""
        check_num_steps(num_steps)
        self._check_claimed(data.request_id)
        check_window(data)
        check_fits(data, num_steps, self.max_seq_len)
        return True

    @synchronized
    def step(self, batch: Sequence[TextGenerationContext]) -> None:
        """Checks that every request is claimed; records nothing."""
        for ctx in batch:
            self._check_claimed(ctx.request_id)

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
            self._check_claimed(ctx.request_id)
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
        self._check_claimed(context.request_id)
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
