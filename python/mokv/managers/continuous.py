"""ContinuousKVCacheManager: one contiguous `max_seq_len` slot per request.

It implements the manager contract (base.py) by request: `external_claim(request_id)`,
`maybe_reserve(ctx)`, `fetch([ctx, ...])`, `step([ctx, ...])`, `release(request_id)`;
cache lengths come from each context's `start_idx`, so a scheduler can swap it for the
paged manager (`load_kv_manager` builds it for `KVCacheStrategy.CONTINUOUS`).

MAX's sequence-id flow (`claim(n) -> seq_ids`, `fetch(seq_ids)`,
`step({seq_id: new_tokens})`, `release(seq_id)`) is another class over the same slots:
`ContinuousBatchingKVCacheManager` (sequences.py), which takes and gives back slots
through `take_slots` / `give_back_slots` and builds its inputs with `slot_inputs`.

Memory: `max_cache_batch_size * 2 * num_layers * max_seq_len * n_kv_heads * head_dim *
dtype size` bytes (and the scales of scaled FP8 pages), split over the devices by KV
head (layout in `mokv.layouts.continuous`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.engine import InferenceSession

from ..cache.cache_memory import cache_buffer
from ..config.params import KVCacheParams
from ..context import RequestID, TextGenerationContext
from ..errors import (
    AlreadyClaimedError,
    BatchTooLargeError,
    InvalidReplicaError,
    StaleContextError,
    UnknownRequestError,
)
from ..layouts import (
    CONTINUOUS,
    ContinuousBatchingKVCacheInputs,
    ScaledContinuousBatchingKVCacheInputs,
)
from ..metrics import KVCacheMetrics, prompt_tokens_in
from .base import (
    MaxManagerAPI,
    atomic,
    check_distinct,
    check_fits,
    check_num_steps,
    check_request_id,
    check_window,
    integer_tokens,
    refuse_paged_features,
    synchronized,
)
from .increment import CacheLengthIncrementer, row_offsets_for
from .sequence_checks import too_few_slots


class ContinuousKVCacheManager(MaxManagerAPI):
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
        super().__init__(
            params, CONTINUOUS, max_cache_batch_size, max_seq_len, num_layers, devices, session
        )
        if params.data_parallel_degree != 1:
            raise ValueError(
                "the continuous-batching cache has no data-parallel replicas: "
                f"data_parallel_degree={params.data_parallel_degree}"
            )
        refuse_paged_features(params, "the continuous-batching cache")
        self.max_cache_batch_size = max_cache_batch_size
        shape = self.block_shape(max_cache_batch_size)
        self.blocks = [cache_buffer(params.dtype, shape, d) for d in self.devices]
        scales_shape = params.scales_shape(shape)
        # Scaled FP8 pages: the scales of each slot, beside `blocks` on each device.
        self.scales: list[Buffer] | None = (
            None
            if params.quantization is None or scales_shape is None
            else [
                cache_buffer(params.quantization.scale_dtype, scales_shape, d) for d in self.devices
            ]
        )
        self._free_slots = list(range(max_cache_batch_size - 1, -1, -1))
        self._slot_of: dict[RequestID, int] = {}
        self._prompt_end: dict[RequestID, int] = {}  # end_idx at a request's first fetch
        self._reserved: dict[RequestID, int] = {}  # tokens of cache reserved for a request
        self._input_tokens = 0  # prompt tokens fetched (the metrics count no decode token)
        self._increment = CacheLengthIncrementer(session, with_max_lengths=False)

    # --- sizing ---------------------------------------------------------------------

    def block_shape(self, n_sequences: int) -> list[int]:
        """`[n_sequences, 2, num_layers, max_seq_len, n_kv_heads_per_device, head_dim]`."""
        p = self.params
        return [
            n_sequences,
            2,
            self.num_layers,
            self.max_seq_len,
            p.n_kv_heads_per_device,
            p.head_dim,
        ]

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
    def batch_size_for(
        cls, params: KVCacheParams, max_seq_len: int, num_layers: int, memory: int
    ) -> int:
        """Slots that fit the budget: `max(1, floor(memory / (max_seq_len * bytes_per_token)))`."""
        return max(1, memory // (max_seq_len * params.bytes_per_token(num_layers)))

    # --- slots (the requests', and the sequence ids' of sequences.py) ----------------

    @synchronized
    def take_slots(self, n: int, what: str) -> list[int]:
        """`n` free slots, lowest first; BatchTooLargeError naming `what` (and nothing
        taken) if fewer are free."""
        if n > len(self._free_slots):
            raise too_few_slots(what, len(self._free_slots), self.max_cache_batch_size)
        slots = [self._free_slots.pop() for _ in range(n)]
        self._undo.push(self._free_slots.extend, slots[::-1])
        return slots

    @synchronized
    def free_slots(self) -> set[int]:
        """The slots neither a request nor a sequence holds (a copy)."""
        return set(self._free_slots)

    @synchronized
    def give_back_slots(self, slots: Sequence[int]) -> None:
        """Frees slots that `take_slots` handed out (and no request holds)."""
        self._undo.push(self._free_slots.__delitem__, slice(len(self._free_slots), None))
        self._free_slots.extend(slots)

    def slot_inputs(self, slots: list[int], lengths: list[int]) -> list[Any]:
        """One tuple per device for a batch of slots and their cache lengths
        (`ScaledContinuousBatchingKVCacheInputs` for scaled pages)."""
        cache_lengths = np.array(lengths, dtype=np.uint32)
        host = [
            Buffer.from_numpy(cache_lengths),
            Buffer.from_numpy(np.array(slots, dtype=np.uint32)),
        ]
        is_empty = Buffer.from_numpy(np.array([not cache_lengths.any()], dtype=np.bool_))
        tables = [host if d.is_host else [b.to(d) for b in host] for d in self.devices]
        inputs = [
            ContinuousBatchingKVCacheInputs(blocks, device_lengths, device_slots, is_empty)
            for blocks, (device_lengths, device_slots) in zip(self.blocks, tables)
        ]
        if self.scales is None:
            return inputs
        return [
            ScaledContinuousBatchingKVCacheInputs(*device_inputs, scales)
            for device_inputs, scales in zip(inputs, self.scales)
        ]

    # --- requests (the manager contract) ----------------------------------------------

    @atomic
    def external_claim(self, request_id: RequestID, replica_idx: int | None = None) -> None:
        """Gives the request a slot (BatchTooLargeError when all are taken)."""
        check_request_id(request_id)
        if replica_idx is not None and (replica_idx.__class__ is not int or replica_idx != 0):
            raise InvalidReplicaError(f"replica_idx={replica_idx!r}: this cache has one replica")
        if request_id in self._slot_of:
            raise AlreadyClaimedError(request_id)
        (self._slot_of[request_id],) = self.take_slots(1, repr(request_id))
        self._undo.push(self._slot_of.pop, request_id)

    @synchronized
    def contains(self, request_id: RequestID) -> bool:
        """Whether the request holds a slot."""
        check_request_id(request_id)
        return request_id in self._slot_of

    @synchronized
    def release(self, request_id: RequestID) -> None:
        """Frees the request's slot."""
        self._free_slots.append(self._slot(request_id))
        del self._slot_of[request_id]
        self._prompt_end.pop(request_id, None)
        self._reserved.pop(request_id, None)

    def _slot(self, request_id: RequestID) -> int:
        check_request_id(request_id)
        try:
            return self._slot_of[request_id]
        except KeyError:
            raise UnknownRequestError(request_id) from None

    @synchronized
    def get_req_blocks(self, request_id: RequestID) -> list[int]:
        """The one slot the request holds."""
        return [self._slot(request_id)]

    @synchronized
    def get_replica(self, context: TextGenerationContext) -> int:
        self._slot(context.request_id)
        return 0

    @synchronized
    def get_or_recommend_replica(self, context: TextGenerationContext) -> int:
        return 0

    def _check_reservation(self, ctx: TextGenerationContext, num_steps: int) -> int:
        """The tokens of cache `ctx` needs for `num_steps` steps; raises for an unknown
        request, a bad window, non-integer tokens (at its first reservation) or a window
        past `max_seq_len`."""
        self._slot(ctx.request_id)
        check_window(ctx)
        if ctx.request_id not in self._reserved:
            integer_tokens(ctx)
        check_fits(ctx, num_steps, self.max_seq_len)
        return ctx.active_idx + num_steps - 1

    def _note_reserved(self, request_id: RequestID, needed: int) -> None:
        reserved = self._reserved.get(request_id)
        if reserved is None or needed > reserved:
            self._undo.push(self._unreserve, request_id, reserved)
            self._reserved[request_id] = needed

    def _unreserve(self, request_id: RequestID, reserved: int | None) -> None:
        if reserved is None:
            self._reserved.pop(request_id, None)
        else:
            self._reserved[request_id] = reserved

    @atomic
    def maybe_reserve(self, data: TextGenerationContext, num_steps: int = 1) -> bool:
        """True: a claimed request's slot always has room up to `max_seq_len` (it
        records how far `step` may find the request's cache)."""
        check_num_steps(num_steps)
        self._note_reserved(data.request_id, self._check_reservation(data, num_steps))
        return True

    @atomic
    def fetch(self, batch: Sequence[TextGenerationContext], num_steps: int = 1) -> list[Any]:
        """Graph inputs for a batch of contexts, one tuple per device (`slot_inputs`)."""
        check_num_steps(num_steps)
        if len(batch) > self.max_cache_batch_size:
            raise BatchTooLargeError(
                f"batch of {len(batch)} is larger than "
                f"max_cache_batch_size={self.max_cache_batch_size}"
            )
        needed = [self._check_reservation(ctx, num_steps) for ctx in batch]
        check_distinct(batch)
        slots = [self._slot_of[ctx.request_id] for ctx in batch]
        inputs = self.slot_inputs(slots, [ctx.start_idx for ctx in batch])
        self._undo.push(setattr, self, "_input_tokens", self._input_tokens)
        for ctx, n in zip(batch, needed):
            self._note_reserved(ctx.request_id, n)
            if ctx.request_id not in self._prompt_end:
                self._undo.push(self._prompt_end.pop, ctx.request_id)
                self._prompt_end[ctx.request_id] = ctx.end_idx
            prompt_end = self._prompt_end[ctx.request_id]
            self._input_tokens += prompt_tokens_in(ctx.start_idx, ctx.active_idx, prompt_end)
        return inputs

    @synchronized
    def step(self, batch: Sequence[TextGenerationContext]) -> None:
        """Nothing to record (`fetch` reads `ctx.start_idx`); every request must hold a
        slot, and its cache end inside what `maybe_reserve` or `fetch` reserved
        (StaleContextError, as the paged manager's, for a step without a reservation)."""
        for ctx in batch:
            self._slot(ctx.request_id)
            reserved = self._reserved.get(ctx.request_id, 0)
            if ctx.start_idx > reserved:
                raise StaleContextError(
                    f"request {ctx.request_id!r} has start_idx={ctx.start_idx} but only "
                    f"{reserved} tokens of cache were reserved for it (maybe_reserve or "
                    "fetch before step)"
                )

    @synchronized
    def increment_cache_lengths(
        self,
        kv_cache_inputs: Sequence[Any],
        prev_model_inputs: Any,
    ) -> list[Any]:
        """Inputs for the next step of multistep decoding: cache lengths grow by the rows
        each sequence processed, and `is_cache_empty` is False (only a first step encodes
        a context)."""
        offsets = row_offsets_for(kv_cache_inputs, prev_model_inputs, 1, len(self.devices))
        not_empty = Buffer.from_numpy(np.array([False]))
        return [
            inputs._replace(
                cache_lengths=self._increment(inputs.cache_lengths, row_offsets)[0],
                is_cache_empty=not_empty,
            )
            for inputs, row_offsets in zip(kv_cache_inputs, offsets, strict=True)
        ]

    @synchronized
    def get_data_parallel_splits(self, context_batch: Sequence[Any]) -> Buffer:
        """int64 `[0, len(batch)]`: one replica holds the whole batch (of claimed requests)."""
        for ctx in context_batch:
            self._slot(ctx.request_id)
        return Buffer.from_numpy(np.array([0, len(context_batch)], dtype=np.int64))

    # --- occupancy and metrics (a slot plays the part of a page) --------------------

    @property
    @synchronized
    def num_free_blocks(self) -> int:
        return len(self._free_slots)

    @property
    @synchronized
    def free_blocks_pct(self) -> float:
        return len(self._free_slots) / self.max_cache_batch_size

    @property
    @synchronized
    def used_blocks_pct(self) -> float:
        return 1.0 - self.free_blocks_pct

    @property
    @synchronized
    def metrics(self) -> KVCacheMetrics:
        return KVCacheMetrics(
            input_tokens=self._input_tokens,
            used_pages=self.max_cache_batch_size - len(self._free_slots),
            free_pages=len(self._free_slots),
        )

    @synchronized
    def reset_metrics(self) -> None:
        self._input_tokens = 0

    @synchronized
    def reset_prefix_cache(self) -> bool:
        """Nothing to forget (slots are never shared): True."""
        return True
