"""NullKVCacheManager: the manager interface with no memory behind it (seed 001).

Compile-only builds run on virtual devices (`max.driver.set_virtual_device_*`), where
no buffer can be used. This manager lets the same model code build its graph there:
it returns the real paged manager's graph input types, and runtime inputs of the
right dtypes and ranks that hold nothing (zero pages, on the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, TensorType

from ..context import RequestID, TextGenerationContext
from ..inputs import RaggedKVCacheInputs, paged_input_symbols
from ..metrics import KVCacheMetrics
from ..params import KVCacheParams
from .base import KVCacheManager


class NullKVCacheManager(KVCacheManager):
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
        super().__init__(params, max_batch_size, max_seq_len, num_layers, devices, session)
        self.available_cache_memory = available_cache_memory
        self.page_size = params.page_size
        self._claimed: set[RequestID] = set()
        self._metrics = KVCacheMetrics()

    @classmethod
    def estimated_memory_size(cls, *args: Any, **kwargs: Any) -> int:
        """Always 0: nothing is allocated."""
        return 0

    @classmethod
    def infer_optimal_batch_size(cls, *args: Any, **kwargs: Any) -> int:
        """Always 1."""
        return 1

    def external_claim(self, request_id: RequestID, replica_idx: int | None = None) -> None:
        """Records the id, so that `contains` answers as a real manager would."""
        self._claimed.add(request_id)

    def contains(self, request_id: RequestID) -> bool:
        return request_id in self._claimed

    def release(self, request_id: RequestID) -> None:
        self._claimed.discard(request_id)

    def maybe_reserve(self, data: TextGenerationContext, num_steps: int = 1) -> bool:
        return True

    def step(self, batch: Sequence[TextGenerationContext]) -> None:
        """No-op."""

    def fetch(
        self, batch: Sequence[TextGenerationContext], num_steps: int = 1
    ) -> list[RaggedKVCacheInputs[Buffer, Buffer]]:
        """One `RaggedKVCacheInputs` of host buffers with the right dtypes and ranks,
        holding zero pages."""
        p = self.params
        shape = (0, 2, self.num_layers, p.page_size, p.n_kv_heads_per_device, p.head_dim)
        return [
            RaggedKVCacheInputs(
                blocks=Buffer(p.dtype, shape),
                cache_lengths=Buffer.from_numpy(np.zeros(len(batch), dtype=np.uint32)),
                lookup_table=Buffer.from_numpy(np.zeros((len(batch), 1), dtype=np.uint32)),
                max_lengths=Buffer.from_numpy(np.zeros((num_steps, 2), dtype=np.uint32)),
            )
        ]

    def increment_cache_lengths(self, kv_cache_inputs: Any, prev_model_inputs: Any) -> Any:
        """Returns `kv_cache_inputs` unchanged."""
        return kv_cache_inputs

    def input_symbols(
        self, devices: Sequence[Device] | None = None, num_layers: int | None = None
    ) -> list[RaggedKVCacheInputs[BufferType, TensorType]]:
        """The same types as `PagedKVCacheManager.input_symbols`."""
        return [
            paged_input_symbols(self.params, num_layers or self.num_layers, DeviceRef.from_device(d))
            for d in (devices or self.devices)
        ]

    def get_data_parallel_splits(self, batch: Sequence[TextGenerationContext]) -> list[list[int]]:
        """A single split holding every batch index."""
        return [list(range(len(batch)))]

    def get_or_recommend_replica(self, context: TextGenerationContext) -> int:
        return 0

    def get_replica(self, context: TextGenerationContext) -> int:
        return 0

    def get_req_blocks(self, request_id: RequestID) -> list[int]:
        return []

    @property
    def num_free_blocks(self) -> int:
        """A dummy 1000."""
        return 1000

    @property
    def free_blocks_pct(self) -> float:
        return 1.0

    @property
    def used_blocks_pct(self) -> float:
        return 0.0

    @property
    def metrics(self) -> KVCacheMetrics:
        return self._metrics

    def reset_metrics(self) -> None:
        self._metrics = KVCacheMetrics()

    def reset_prefix_cache(self) -> None:
        """No-op."""
