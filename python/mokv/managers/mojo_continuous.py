"""MojoContinuousBatchingKVCacheManager: the Mojo continuous-batching manager, driven from Python.

The slot state (which sequence holds which slot, how many tokens each has committed)
lives in Mojo, in `mokv.slots.ContinuousBatchingSlotTable` behind a spin lock, together
with the cache's blocks buffer; this class is a thin typed front end over the
`mokv_manager_ext` extension module (mojo/python_ext/, built and cached by
`mokv.extensions`). It offers the calls of `ContinuousBatchingKVCacheManager` (the
Python sequence-id manager, sequences.py) with the same semantics and errors:

    claim(n) -> seq_ids     fetch(seq_ids) -> [ContinuousBatchingKVCacheInputs]
    step({seq_id: n})       release(seq_id)      contains(seq_id)

A sequence id is its slot; slots are handed out lowest first and a reclaimed slot
starts empty. The blocks are a numpy array and a MAX `Buffer` over the Mojo-owned
memory (no copy), so a graph built from `input_symbols()` reads and writes the cache
that the Mojo manager owns. The Mojo calls release the GIL, so Python threads may
claim, fetch, step and release concurrently. CPU only (one device).

Arguments are checked here, before the Mojo call, by the Python manager's own checks
(`sequence_checks`): the same inputs are refused with the same errors and messages,
and no Python value the extension would convert loosely (a float, a bool, an int past
64 bits) reaches it. The Mojo table checks again under its lock (another thread may
have released an id since), with errors of the same types.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession

from .. import extensions
from ..config.params import KVCacheParams
from ..errors import BatchTooLargeError, SequenceTooLongError, UnknownRequestError
from ..layouts import CONTINUOUS, ContinuousBatchingKVCacheInputs
from . import sequence_checks as checks
from .base import ManagerFields, refuse_paged_features

_STORAGE = {DType.float32: np.float32, DType.float16: np.float16, DType.bfloat16: np.uint16}
"""numpy type holding each cache dtype (bfloat16 as its uint16 bit patterns)."""

R = TypeVar("R")


def _typed_error(exc: Exception) -> Exception:
    """The mokv error that a Mojo error's `Kind: message` text stands for."""
    kind, sep, message = str(exc).partition(": ")
    if not sep:
        return exc
    if kind == "UnknownRequestError":
        found = re.search(r"sequence id (-?\d+)", message)
        return UnknownRequestError(int(found.group(1)) if found else message)
    if kind == "BatchTooLargeError":
        found = re.search(r"cannot claim (\d+) sequences: (\d+) of (\d+)", message)
        if found:
            n, free, slots = (int(g) for g in found.groups())
            return checks.too_few_slots(f"{n} sequences", free, slots)
        return BatchTooLargeError(message)
    if kind == "SequenceTooLongError":
        found = re.search(
            r"sequence (\d+) holds (\d+) tokens: (\d+) new tokens would pass max_seq_len=(\d+)",
            message,
        )
        if found:
            return checks.too_long(*(int(g) for g in found.groups()))
        return SequenceTooLongError(message)
    if kind == "ValueError":
        return ValueError(message)
    if kind == "TypeError":
        return TypeError(message)
    return exc


def _call(fn: Callable[..., R], *args: Any) -> R:
    try:
        return fn(*args)
    except Exception as exc:
        typed = _typed_error(exc)
        if typed is exc:
            raise
        raise typed from None


class MojoContinuousBatchingKVCacheManager(ManagerFields):
    """A continuous-batching KV cache whose state and memory the Mojo manager owns.

    Args: as `ContinuousBatchingKVCacheManager` (`params.n_devices` must be 1 and the
    device a CPU).

    It has the continuous layout's fields and `input_symbols`, and MAX's sequence-id
    flow rather than the request contract (`KVCacheManager`); the Mojo struct is
    thread-safe itself, so no Python lock is taken.
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
        if len(self.devices) != 1 or not self.devices[0].is_host:
            raise ValueError(f"the Mojo manager runs on one CPU device, got {self.devices!r}")
        refuse_paged_features(params, "the Mojo continuous-batching manager")
        if params.dtype not in _STORAGE:
            raise TypeError(f"cache dtype must be float32, bfloat16 or float16, got {params.dtype}")
        self.max_cache_batch_size = max_cache_batch_size
        storage = np.dtype(_STORAGE[params.dtype])
        shape = [
            max_cache_batch_size,
            2,
            num_layers,
            max_seq_len,
            params.n_kv_heads_per_device,
            params.head_dim,
        ]
        ext = extensions.load("mokv_manager_ext", imports_kernels=True)
        self._native = ext.ContinuousBatchingKVCacheManager(
            max_cache_batch_size,
            max_seq_len,
            num_layers,
            params.n_kv_heads_per_device,
            params.head_dim,
            storage.itemsize,
        )
        nbytes = self._native.blocks_nbytes()
        raw = (ctypes.c_uint8 * nbytes).from_address(self._native.blocks_address())
        # The views keep `raw` alive, and `raw` the native object that owns the memory.
        raw._owner = self._native
        self.blocks_array: np.ndarray = np.frombuffer(raw, dtype=storage).reshape(shape)
        """The cache as numpy (bfloat16 as uint16 bits), aliasing the Mojo-owned memory."""
        buffer = Buffer.from_numpy(self.blocks_array)
        self.blocks: list[Buffer] = [
            buffer.view(DType.bfloat16) if params.dtype == DType.bfloat16 else buffer
        ]
        """One `Buffer` per device over the same memory: `fetch`'s `blocks`."""
        # `is_cache_empty` is read-only in the graph: two shared host tensors do.
        self._is_empty = {
            flag: Buffer.from_numpy(np.array([flag], dtype=np.bool_)) for flag in (False, True)
        }

    # --- lifecycle ------------------------------------------------------------------

    def claim(self, n: int) -> list[int]:
        """`n` new sequence ids (positive int; `BatchTooLargeError` past the free slots)."""
        checks.check_claim(n)
        if n > self.max_cache_batch_size:  # never fits; and it may not fit an Int
            raise checks.too_few_slots(
                f"{n} sequences", self.num_free_blocks, self.max_cache_batch_size
            )
        return _call(self._native.claim, n)

    def step(self, batch: Mapping[int, int]) -> None:
        """Commits `{seq_id: new_tokens}`; all or nothing."""
        checks.check_step(batch, self.max_cache_batch_size)
        if any(n > self.max_seq_len for n in batch.values()):
            self._refuse_step(batch)  # never fits; and it may not fit an Int
        _call(self._native.step, list(batch.keys()), list(batch.values()))

    def _refuse_step(self, batch: Mapping[int, int]) -> None:
        """Raises what the Mojo table would for a step that cannot fit, in its order."""
        for seq_id in batch:
            if not self._native.contains(seq_id):
                raise UnknownRequestError(seq_id)
        for seq_id, n in batch.items():
            length = _call(self._native.cache_length, seq_id)
            if length + n > self.max_seq_len:
                raise checks.too_long(seq_id, length, n, self.max_seq_len)

    def fetch(
        self, seq_ids: Sequence[int], num_steps: int = 1
    ) -> list[ContinuousBatchingKVCacheInputs[Buffer, Buffer]]:
        """Graph inputs of a batch of sequence ids (one tuple: one device)."""
        ids = checks.check_fetch(seq_ids, num_steps, self.max_cache_batch_size)
        arrays = np.empty((2, len(ids)), dtype=np.uint32)  # cache_lengths, lookup_table
        is_empty = _call(self._native.lookup, ids, arrays.ctypes.data)
        checks.check_room(ids, arrays[0].tolist(), num_steps, self.max_seq_len)
        return [
            ContinuousBatchingKVCacheInputs(
                self.blocks[0],
                Buffer.from_numpy(arrays[0]),
                Buffer.from_numpy(arrays[1]),
                self._is_empty[is_empty],
            )
        ]

    def release(self, seq_id: int) -> None:
        """Frees the slot of `seq_id` (`UnknownRequestError` if it is not claimed)."""
        checks.check_ids([seq_id], self.max_cache_batch_size)
        _call(self._native.release, seq_id)

    # --- queries --------------------------------------------------------------------

    def contains(self, seq_id: int) -> bool:
        """Whether `seq_id` is a claimed sequence (False for anything else)."""
        # An id out of the slots' range is never claimed (nor fits the extension's Int).
        return (
            checks.is_count(seq_id)
            and 0 <= seq_id < self.max_cache_batch_size
            and bool(self._native.contains(seq_id))
        )

    def cache_length(self, seq_id: int) -> int:
        """Tokens committed for `seq_id`."""
        checks.check_ids([seq_id], self.max_cache_batch_size)
        return _call(self._native.cache_length, seq_id)

    @property
    def slot_lengths(self) -> list[int]:
        """Every slot's committed length (a free slot keeps its last one until reclaimed)."""
        return self._native.slot_lengths()

    @property
    def num_free_blocks(self) -> int:
        return self._native.num_free_slots()

    @property
    def seq_id_counter(self) -> int:
        """Sequences claimed since construction."""
        return self._native.seq_id_counter()
