"""The paged manager's multistep and data-parallel helpers (MAX's calls): the next
step's inputs computed on the device, and each replica's share of a batch. Functions of
what they are given: the manager's methods call them under its lock."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from max.driver import Buffer

from ...config.params import KVCacheParams
from ...layouts.paged import PagedInputs
from ..increment import CacheLengthIncrementer, row_offsets_for


def increment_cache_lengths(
    increment: CacheLengthIncrementer,
    params: KVCacheParams,
    num_replicas: int,
    kv_cache_inputs: Sequence[PagedInputs[Buffer, Buffer]],
    prev_model_inputs: Any,
) -> list[PagedInputs[Buffer, Buffer]]:
    """Inputs for the next step of multistep decoding, computed on the device.

    `prev_model_inputs.input_row_offsets` (or the offsets themselves) gives the rows
    each request processed: one Buffer for a single replica; with several, MAX's form
    (one global Buffer plus `prev_model_inputs.data_parallel_splits`, as
    `get_data_parallel_splits` returns them), or one Buffer per replica or per device.
    Cache lengths grow by those counts and `max_lengths` drops a row.
    """
    offsets = row_offsets_for(
        kv_cache_inputs,
        prev_model_inputs,
        num_replicas,
        params.tensor_parallel_degree,
    )
    out = []
    for inputs, row_offsets in zip(kv_cache_inputs, offsets, strict=True):
        cache_lengths, max_lengths = increment(
            inputs.cache_lengths, row_offsets, inputs.max_lengths
        )
        out.append(inputs._replace(cache_lengths=cache_lengths, max_lengths=max_lengths))
    return out


def data_parallel_splits(replica_indices: Sequence[int], num_replicas: int) -> Buffer:
    """int64 `[num_replicas + 1]`: offsets of each replica's requests in the batch,
    `[0, n_0, n_0 + n_1, ...]`, in the order `fetch` groups them (replica by replica,
    whatever the batch's order)."""
    counts = np.zeros(num_replicas + 1, dtype=np.int64)
    for replica_idx in replica_indices:
        counts[replica_idx + 1] += 1
    return Buffer.from_numpy(np.cumsum(counts))
