"""ContinuousBatchingKVCacheManager: one contiguous `max_seq_len` slot per sequence (seed 002).

Two ways to drive it, over the same slots:

- by sequence id (seed 002/003): `claim(n) -> seq_ids`, `fetch(seq_ids)`,
  `step({seq_id: new_tokens})`, `release(seq_id)`; the manager counts cache lengths;
- by request context, like the paged manager, so that a scheduler can swap one for the
  other: `external_claim(request_id)`, `maybe_reserve(ctx)`, `fetch([ctx, ...])`,
  `step([ctx, ...])`, `release(request_id)`; cache lengths come from `ctx.start_idx`.

Memory: `max_cache_batch_size * 2 * num_layers * max_seq_len * n_kv_heads * head_dim *
dtype size` bytes, split over the devices by KV head (layout in `mokv.inputs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, TensorType

from ..context import RequestID, TextGenerationContext
from ..errors import (
    AlreadyClaimedError,
    BatchTooLargeError,
    InvalidReplicaError,
    SequenceTooLongError,
    UnknownRequestError,
)
from ..inputs import ContinuousBatchingKVCacheInputs, continuous_input_symbols
from ..metrics import KVCacheMetrics
from ..params import KVCacheParams
from .base import KVCacheManager
from .increment import CacheLengthIncrementer, row_offsets_per_device

SeqIdsOrContexts = Sequence[int] | Sequence[TextGenerationContext]


class ContinuousBatchingKVCacheManager(KVCacheManager):
    """A KV cache of `max_cache_batch_size` contiguous slots (tensor parallel over heads).

    Args:
        params: cache shape (`data_parallel_degree` must be 1).
        max_cache_batch_size: number of slots: sequences held at once.
        max_seq_len: tokens per slot.
        num_layers: transformer layers.
        devices: `params.n_devices` devices, each holding `n_kv_heads_per_device` heads.
        session: the InferenceSession that runs the model.
    """

    def __init__(
        self,
        params: KVCacheParams,
        max_cache_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
        session: InferenceSession,
    ) -> None:
        super().__init__(params, max_cache_batch_size, max_seq_len, num_layers, devices, session)
        if params.data_parallel_degree != 1:
            raise ValueError(
                "the continuous-batching cache has no data-parallel replicas: "
                f"data_parallel_degree={params.data_parallel_degree}"
            )
        self.max_cache_batch_size = max_cache_batch_size
        shape = self.block_shape(max_cache_batch_size)
        self.blocks = [Buffer(params.dtype, shape, device=d) for d in self.devices]
        self._free_slots = list(range(max_cache_batch_size - 1, -1, -1))
        self._cache_lengths = [0] * max_cache_batch_size
        self._slot_of: dict[RequestID, int] = {}
        self._seq_ids: set[int] = set()  # slots claimed by sequence id
        self._input_tokens = 0
        self._increment = CacheLengthIncrementer(session, with_max_lengths=False)

    # --- sizing ---------------------------------------------------------------------

    def block_shape(self, n_sequences: int) -> list[int]:
        """`[n_sequences, 2, num_layers, max_seq_len, n_kv_heads_per_device, head_dim]`."""
        p = self.params
        return [n_sequences, 2, self.num_layers, self.max_seq_len, p.n_kv_heads_per_device, p.head_dim]

    @classmethod
    def estimated_memory_size(
        cls,
        params: KVCacheParams,
        max_cache_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
        **kwargs: Any,
    ) -> int:
        """`max_cache_batch_size * max_seq_len * bytes_per_token(num_layers)`, all devices."""
        return max_cache_batch_size * max_seq_len * params.bytes_per_token(num_layers)

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
        """Slots that fit the budget: `max(1, floor(memory / (max_seq_len * bytes_per_token)))`."""
        return max(1, available_cache_memory // (max_seq_len * params.bytes_per_token(num_layers)))

    # --- claiming -------------------------------------------------------------------

    def _take_slot(self, what: str) -> int:
        if not self._free_slots:
            raise BatchTooLargeError(
                f"cannot claim {what}: all {self.max_cache_batch_size} slots are taken"
            )
        slot = self._free_slots.pop()
        self._cache_lengths[slot] = 0
        return slot

    def claim(self, request_id_or_n: RequestID | int, replica_idx: int | None = None) -> Any:  # type: ignore[override]
        """`claim(n)` returns `n` new sequence ids; `claim(request_id)` is `external_claim`."""
        if isinstance(request_id_or_n, int):
            if request_id_or_n > len(self._free_slots):
                raise BatchTooLargeError(
                    f"cannot claim {request_id_or_n} sequences: {len(self._free_slots)} of "
                    f"{self.max_cache_batch_size} slots are free"
                )
            seq_ids = [self._take_slot("a sequence") for _ in range(request_id_or_n)]
            self._seq_ids.update(seq_ids)
            return seq_ids
        return self.external_claim(request_id_or_n, replica_idx)

    def external_claim(self, request_id: RequestID, replica_idx: int | None = None) -> None:
        if replica_idx not in (None, 0):
            raise InvalidReplicaError(f"replica_idx={replica_idx!r}: this cache has one replica")
        if request_id in self._slot_of:
            raise AlreadyClaimedError(request_id)
        self._slot_of[request_id] = self._take_slot(repr(request_id))

    def contains(self, key: RequestID | int) -> bool:
        return key in self._seq_ids if isinstance(key, int) else key in self._slot_of

    def release(self, key: RequestID | int) -> None:
        """Frees the slot of a request id or a sequence id."""
        slot = self._slot(key)
        if isinstance(key, int):
            self._seq_ids.discard(key)
        else:
            del self._slot_of[key]
        self._free_slots.append(slot)

    def _slot(self, key: RequestID | int) -> int:
        if isinstance(key, int):
            if key not in self._seq_ids:
                raise UnknownRequestError(key)
            return key
        try:
            return self._slot_of[key]
        except KeyError:
            raise UnknownRequestError(key) from None

    def get_req_blocks(self, request_id: RequestID) -> list[int]:
        """The one slot the request holds."""
        return [self._slot(request_id)]

    def get_replica(self, context: TextGenerationContext) -> int:
        self._slot(context.request_id)
        return 0

    def get_or_recommend_replica(self, context: TextGenerationContext) -> int:
        return 0

    # --- steps ----------------------------------------------------------------------

    def _check_fits(self, ctx: TextGenerationContext, num_steps: int) -> None:
        needed = ctx.active_idx + num_steps - 1
        if needed > self.max_seq_len:
            raise SequenceTooLongError(
                f"request {ctx.request_id!r} needs {needed} tokens of cache for {num_steps} "
                f"step(s), past max_seq_len={self.max_seq_len}"
            )

    def maybe_reserve(self, data: TextGenerationContext, num_steps: int = 1) -> bool:
        """True: a claimed request's slot always has room up to `max_seq_len`."""
        self._check_num_steps(num_steps)
        self._slot(data.request_id)
        self._check_fits(data, num_steps)
        return True

    def fetch(
        self, batch: SeqIdsOrContexts, num_steps: int = 1
    ) -> list[ContinuousBatchingKVCacheInputs[Buffer, Buffer]]:
        """Graph inputs for a batch of sequence ids or contexts, one tuple per device."""
        self._check_num_steps(num_steps)
        if len(batch) > self.max_cache_batch_size:
            raise BatchTooLargeError(
                f"batch of {len(batch)} is larger than max_cache_batch_size={self.max_cache_batch_size}"
            )
        slots = [self._slot(x if isinstance(x, int) else x.request_id) for x in batch]
        if batch and not isinstance(batch[0], int):
            for ctx in batch:
                self._check_fits(ctx, num_steps)  # type: ignore[arg-type]
            lengths = [ctx.start_idx for ctx in batch]  # type: ignore[union-attr]
            self._input_tokens += sum(ctx.active_length for ctx in batch)  # type: ignore[union-attr]
        else:
            lengths = [self._cache_lengths[s] for s in slots]
        cache_lengths = np.array(lengths, dtype=np.uint32)
        host = [Buffer.from_numpy(cache_lengths), Buffer.from_numpy(np.array(slots, dtype=np.uint32))]
        is_empty = Buffer.from_numpy(np.array([not cache_lengths.any()], dtype=np.bool_))
        return [
            ContinuousBatchingKVCacheInputs(
                blocks, *(host if d.is_host else [b.to(d) for b in host]), is_empty
            )
            for blocks, d in zip(self.blocks, self.devices)
        ]

    def step(self, batch: Mapping[int, int] | Sequence[TextGenerationContext]) -> None:
        """Records a step: `{seq_id: tokens written}` or the contexts after `update`."""
        if isinstance(batch, Mapping):
            slots = [self._slot(seq_id) for seq_id in batch]
            grown = [self._cache_lengths[s] + n for s, n in zip(slots, batch.values())]
            too_long = [(s, n) for s, n in zip(batch, grown) if n > self.max_seq_len]
            if too_long:
                raise SequenceTooLongError(
                    f"sequence {too_long[0][0]} would hold {too_long[0][1]} tokens, past "
                    f"max_seq_len={self.max_seq_len}"
                )
            for s, n in zip(slots, grown):
                self._cache_lengths[s] = n
            return
        for ctx in batch:
            self._cache_lengths[self._slot(ctx.request_id)] = ctx.start_idx

    def increment_cache_lengths(
        self,
        kv_cache_inputs: Sequence[ContinuousBatchingKVCacheInputs[Buffer, Buffer]],
        prev_model_inputs: Any,
    ) -> list[ContinuousBatchingKVCacheInputs[Buffer, Buffer]]:
        """Inputs for the next step of multistep decoding: cache lengths grow by the rows
        each sequence processed, and `is_cache_empty` is False (only a first step encodes
        a context)."""
        offsets = row_offsets_per_device(prev_model_inputs, 1, len(self.devices))
        not_empty = Buffer.from_numpy(np.array([False]))
        return [
            inputs._replace(
                cache_lengths=self._increment(inputs.cache_lengths, row_offsets)[0],
                is_cache_empty=not_empty,
            )
            for inputs, row_offsets in zip(kv_cache_inputs, offsets, strict=True)
        ]

    def get_data_parallel_splits(self, context_batch: Sequence[Any]) -> Buffer:
        """int64 `[0, len(batch)]`: one replica holds the whole batch."""
        return Buffer.from_numpy(np.array([0, len(context_batch)], dtype=np.int64))

    def input_symbols(
        self, devices: Sequence[Device] | None = None, num_layers: int | None = None
    ) -> list[ContinuousBatchingKVCacheInputs[BufferType, TensorType]]:
        """Graph input types matching `fetch`'s output, one tuple per device."""
        return [
            continuous_input_symbols(
                self.params, num_layers or self.num_layers, self.max_seq_len, DeviceRef.from_device(d)
            )
            for d in (devices or self.devices)
        ]

    # --- occupancy and metrics (a slot plays the part of a page) --------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_slots)

    @property
    def free_blocks_pct(self) -> float:
        return len(self._free_slots) / self.max_cache_batch_size

    @property
    def used_blocks_pct(self) -> float:
        return 1.0 - self.free_blocks_pct

    @property
    def metrics(self) -> KVCacheMetrics:
        return KVCacheMetrics(
            input_tokens=self._input_tokens,
            used_pages=self.max_cache_batch_size - len(self._free_slots),
            free_pages=len(self._free_slots),
        )

    def reset_metrics(self) -> None:
        self._input_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Nothing to forget: slots are never shared."""
