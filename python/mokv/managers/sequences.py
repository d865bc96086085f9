"""ContinuousBatchingKVCacheManager: MAX's sequence-id flow of the continuous cache.

    manager = ContinuousBatchingKVCacheManager(params, max_cache_batch_size, max_seq_len,
                                               num_layers, devices, session)
    seq_ids = manager.claim(2)              # new sequence ids, each bound to a free slot
    manager.step({seq_ids[0]: 12})          # context encoding wrote 12 tokens
    inputs = manager.fetch(seq_ids)         # cache_lengths come from the counts above
    manager.step({seq_ids[0]: 1, seq_ids[1]: 1})
    manager.release(seq_ids[0])

A sequence id is the int index of its slot, and this class counts each sequence's
cache length. It wraps `requests`, a `ContinuousKVCacheManager` (the request contract,
whose contexts carry their own lengths) over the same slots: the two flows share the
slots but never each other's ids.

It answers the request contract too, by `requests`: `load_kv_manager` returns it for the
continuous strategy, where MAX's own continuous-cache tests (seed 002's release) call
`claim(n=...)`, `fetch(seq_ids=...)` and `step({seq_id: n})`, and mokv's models and
MAX 25.7's interface call `external_claim`, `maybe_reserve`, `fetch(batch)` and
`step(batch)`. The five calls both flows name go by their argument: an int (`claim`,
`contains`, `release`), ints or a mapping (`fetch`, `step`) are sequences; a request id
(a str) or contexts are requests.

One name per thing: `ContinuousBatchingKVCacheManager` is the sequence-id manager, in
Python (this class, MAX's seed 002) and in Mojo (`mojo/mokv/manager.mojo`, seed 003),
with the same calls; `MojoContinuousBatchingKVCacheManager` (mojo_continuous.py) is the
Mojo one driven from Python. Every call checks all of its arguments before it changes
anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, overload

from max.driver import Buffer, Device
from max.engine import InferenceSession

from ..config.params import KVCacheParams
from ..context import RequestID, TextGenerationContext
from ..errors import UnknownRequestError
from ..layouts import CONTINUOUS, ContinuousBatchingKVCacheInputs
from ..metrics import KVCacheMetrics
from .base import MaxManagerAPI, atomic, synchronized
from .continuous import ContinuousKVCacheManager
from .sequence_checks import (
    check_claim,
    check_fetch,
    check_ids,
    check_room,
    check_step,
    is_count,
    too_long,
)


class ContinuousBatchingKVCacheManager(MaxManagerAPI):
    """A continuous-batching KV cache driven by sequence ids (`max_cache_batch_size`
    contiguous slots of `max_seq_len` tokens, tensor parallel over heads).

    Args: those of `ContinuousKVCacheManager` (`params.data_parallel_degree` must be 1).
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
        self.requests = ContinuousKVCacheManager(
            params, max_cache_batch_size, max_seq_len, num_layers, devices, session
        )
        """The request-contract manager over the same slots."""
        super().__init__(
            params, CONTINUOUS, max_cache_batch_size, max_seq_len, num_layers, devices, session
        )
        self.max_cache_batch_size = max_cache_batch_size
        self._lengths: dict[int, int] = {}  # seq_id (= slot) -> tokens in its cache
        # One lock and one undo log with `requests`: both flows change the same slots.
        self._lock, self._undo = self.requests._lock, self.requests._undo

    # --- the cache (as MAX's class describes it) -------------------------------------

    @property
    def blocks(self) -> list[Buffer]:
        """The cache, one `Buffer` per device (shared with `requests`)."""
        return self.requests.blocks

    def block_shape(self, n_sequences: int) -> list[int]:
        """`[n_sequences, 2, num_layers, max_seq_len, n_kv_heads_per_device, head_dim]`."""
        return self.requests.block_shape(n_sequences)

    estimated_memory_size = ContinuousKVCacheManager.estimated_memory_size
    infer_optimal_batch_size = ContinuousKVCacheManager.infer_optimal_batch_size

    def increment_cache_lengths(
        self, kv_cache_inputs: Sequence[Any], prev_model_inputs: Any
    ) -> list[Any]:
        """As `ContinuousKVCacheManager.increment_cache_lengths`."""
        return self.requests.increment_cache_lengths(kv_cache_inputs, prev_model_inputs)

    @property
    def num_free_blocks(self) -> int:
        """Slots neither a sequence nor a request holds."""
        return self.requests.num_free_blocks

    @property
    def slots_remaining(self) -> set[int]:
        """The free slots (MAX's name; a copy): `claim` can take `len(slots_remaining)`
        more sequences."""
        return self.requests.free_slots()

    @property
    def cache_lengths(self) -> Mapping[int, int]:
        """Tokens in each claimed sequence's cache, by sequence id (seed 003's field): a
        read-only view that follows `step`, `claim` and `release`."""
        return MappingProxyType(self._lengths)

    # --- sequence ids ---------------------------------------------------------------

    @overload
    def claim(self, n: int, replica_idx: None = None) -> list[int]: ...

    @overload
    def claim(self, n: RequestID, replica_idx: int | None = None) -> None: ...

    def claim(self, n: int | RequestID, replica_idx: int | None = None) -> list[int] | None:
        """`n` new sequence ids bound to free slots (lowest first), each with length 0;
        for a request id (a str), `external_claim(n, replica_idx)`."""
        if isinstance(n, str):
            return self.requests.external_claim(n, replica_idx)
        if replica_idx is not None:
            raise TypeError(f"claim(n) of sequences takes no replica_idx, got {replica_idx!r}")
        return self._claim(n)

    @atomic
    def _claim(self, n: int) -> list[int]:
        check_claim(n)
        seq_ids = self.requests.take_slots(n, f"{n} sequences")
        self._undo.push(self._forget, seq_ids)
        self._lengths.update((s, 0) for s in seq_ids)
        return seq_ids

    def _forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._lengths.pop(seq_id, None)

    @synchronized
    def contains(self, seq_id: int | RequestID) -> bool:
        """Whether `seq_id` is a claimed sequence (False for another int or value); for
        a request id (a str), whether that request is claimed."""
        if isinstance(seq_id, str):
            return self.requests.contains(seq_id)
        return is_count(seq_id) and seq_id in self._lengths

    def _check(self, seq_id: object) -> int:
        """`seq_id` if it is a claimed sequence (`sequence_checks`)."""
        check_ids([seq_id], self.max_cache_batch_size)
        self._check_claimed([seq_id])  # type: ignore[list-item]
        return seq_id  # type: ignore[return-value]

    def _check_claimed(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            if seq_id not in self._lengths:
                raise UnknownRequestError(seq_id)

    @synchronized
    def cache_length(self, seq_id: int) -> int:
        """Tokens in the sequence's cache."""
        return self._lengths[self._check(seq_id)]

    def release(self, seq_id: int | RequestID) -> None:
        """Frees the sequence's slot; for a request id (a str), releases the request."""
        if isinstance(seq_id, str):
            return self.requests.release(seq_id)
        return self._release(seq_id)

    @atomic
    def _release(self, seq_id: int) -> None:
        self._check(seq_id)
        self.requests.give_back_slots([seq_id])
        self._undo.push(self._lengths.__setitem__, seq_id, self._lengths[seq_id])
        del self._lengths[seq_id]

    def fetch(
        self, seq_ids: Sequence[int] | Sequence[TextGenerationContext], num_steps: int = 1
    ) -> list[ContinuousBatchingKVCacheInputs[Buffer, Buffer]]:
        """One `ContinuousBatchingKVCacheInputs` per device for these sequences
        (`sequence_checks.check_fetch`: room for `num_steps` more tokens each); for a
        batch of contexts, the request contract's `fetch`."""
        items = list(seq_ids)
        if _contexts(items):
            return self.requests.fetch(items, num_steps)  # type: ignore[arg-type]
        return self._fetch(items, num_steps)  # type: ignore[arg-type]

    @synchronized
    def _fetch(
        self, seq_ids: list[int], num_steps: int
    ) -> list[ContinuousBatchingKVCacheInputs[Buffer, Buffer]]:
        slots = check_fetch(seq_ids, num_steps, self.max_cache_batch_size)
        self._check_claimed(slots)
        lengths = [self._lengths[s] for s in slots]
        check_room(slots, lengths, num_steps, self.max_seq_len)
        return self.requests.slot_inputs(slots, lengths)

    def step(self, new_tokens: Mapping[int, int] | Sequence[TextGenerationContext]) -> None:
        """Adds each sequence's newly written token count to its cache length
        (`sequence_checks.check_step`: every id, then every count, then every length);
        for a batch of contexts (or none), the request contract's `step`."""
        if not isinstance(new_tokens, Mapping) and isinstance(new_tokens, Sequence):
            if not new_tokens or _contexts(new_tokens):
                return self.requests.step(new_tokens)
        return self._step(new_tokens)  # type: ignore[arg-type]

    @synchronized
    def _step(self, new_tokens: Mapping[int, int]) -> None:
        check_step(new_tokens, self.max_cache_batch_size)
        self._check_claimed(new_tokens)
        grown = {s: self._lengths[s] + n for s, n in new_tokens.items()}
        for seq_id, length in grown.items():
            if length > self.max_seq_len:
                raise too_long(seq_id, self._lengths[seq_id], new_tokens[seq_id], self.max_seq_len)
        self._lengths.update(grown)

    # --- the request contract, by `requests` (the module docstring says why) ----------

    def external_claim(self, request_id: RequestID, replica_idx: int | None = None) -> None:
        return self.requests.external_claim(request_id, replica_idx)

    def maybe_reserve(self, data: TextGenerationContext, num_steps: int = 1) -> bool:
        return self.requests.maybe_reserve(data, num_steps)

    def get_req_blocks(self, request_id: RequestID) -> list[int]:
        return self.requests.get_req_blocks(request_id)

    def get_replica(self, context: TextGenerationContext) -> int:
        return self.requests.get_replica(context)

    def get_or_recommend_replica(self, context: TextGenerationContext) -> int:
        return self.requests.get_or_recommend_replica(context)

    def get_data_parallel_splits(self, context_batch: Sequence[Any]) -> Buffer:
        return self.requests.get_data_parallel_splits(context_batch)

    @property
    def free_blocks_pct(self) -> float:
        return self.requests.free_blocks_pct

    @property
    def used_blocks_pct(self) -> float:
        return self.requests.used_blocks_pct

    @property
    def metrics(self) -> KVCacheMetrics:
        """The request flow's counters (sequences count no tokens)."""
        return self.requests.metrics

    def reset_metrics(self) -> None:
        self.requests.reset_metrics()

    def reset_prefix_cache(self) -> bool:
        return self.requests.reset_prefix_cache()


def _contexts(items: Sequence[Any]) -> bool:
    """Whether `items` is a batch of contexts (its first item has a `request_id`), not
    of sequence ids."""
    return bool(items) and hasattr(items[0], "request_id")
