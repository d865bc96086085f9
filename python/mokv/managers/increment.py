"""Advance cache lengths between the steps of multistep decoding, on the device.

After a step, each sequence's cache grew by the number of tokens it processed, which
is the difference of consecutive `input_row_offsets`. Doing that add in a tiny MAX
graph keeps the lengths on the device: no copy through the host, no synchronisation.
One graph per device is compiled the first time it is needed and reused after that.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from max.driver import CPU, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType


def _build_graph(device: DeviceRef, with_max_lengths: bool) -> Graph:
    inputs = [
        TensorType(DType.uint32, ["batch_size"], device=device),
        TensorType(DType.uint32, ["num_offsets"], device=device),
    ]
    if with_max_lengths:
        inputs.append(TensorType(DType.uint32, ["steps_remaining", 2], device=DeviceRef.CPU()))
    with Graph("mokv_increment_cache_lengths", input_types=inputs) as graph:
        cache_lengths, row_offsets = graph.inputs[0].tensor, graph.inputs[1].tensor
        grown = (row_offsets[1:] - row_offsets[:-1]).rebind(cache_lengths.shape)
        outputs = [cache_lengths + grown]
        if with_max_lengths:
            outputs.append(graph.inputs[2].tensor[1:])
        graph.output(*outputs)
    return graph


class CacheLengthIncrementer:
    """Compiles, once per device, `cache_lengths + diff(row_offsets)` (and drops a
    `max_lengths` row when asked)."""

    def __init__(self, session: InferenceSession, with_max_lengths: bool) -> None:
        self._session = session
        self._with_max_lengths = with_max_lengths
        self._models: dict[tuple[str, int], Model] = {}

    def _model(self, device: Device) -> Model:
        key = (device.label, device.id)
        if key not in self._models:
            graph = _build_graph(DeviceRef.from_device(device), self._with_max_lengths)
            self._models[key] = self._session.load(graph)
        return self._models[key]

    def __call__(
        self, cache_lengths: Buffer, row_offsets: Buffer, max_lengths: Buffer | None = None
    ) -> list[Buffer]:
        """New cache lengths (and `max_lengths` without its first row)."""
        model = self._model(cache_lengths.device)
        args = [cache_lengths, row_offsets.to(cache_lengths.device)]
        if self._with_max_lengths:
            args.append(max_lengths)
        return list(model.execute(*args))


def row_offsets_per_device(
    prev_model_inputs: Any, num_replicas: int, devices_per_replica: int
) -> list[Buffer]:
    """The previous step's `input_row_offsets`, one per device.

    Accepts an object with an `input_row_offsets` attribute, or the offsets themselves:
    a Buffer or numpy array (one replica), or a sequence with one entry per replica
    (local to that replica's requests) or per device. MAX's form with several replicas:
    one global offsets array over the whole batch (or a list of identical ones, of
    which the first is read) and `prev_model_inputs.data_parallel_splits`, the int64
    `[num_replicas + 1]` offsets of each replica's requests in the batch
    (`get_data_parallel_splits`); each replica then gets its slice of the offsets.
    """
    offsets = getattr(prev_model_inputs, "input_row_offsets", prev_model_inputs)
    splits = getattr(prev_model_inputs, "data_parallel_splits", None)
    if splits is not None and num_replicas > 1:
        whole = offsets[0] if isinstance(offsets, (list, tuple)) else offsets
        _check_row_offsets(whole)
        offsets = _split_by_replica(_as_buffer(whole), splits, num_replicas)
    else:
        if isinstance(offsets, (Buffer, np.ndarray)):
            offsets = [offsets]
        if not isinstance(offsets, (list, tuple)):
            raise TypeError(
                "prev_model_inputs must be input_row_offsets (a Buffer, a numpy array or a "
                "list of them) or carry them as .input_row_offsets, got "
                f"{type(prev_model_inputs).__name__} {prev_model_inputs!r}"
            )
        for o in offsets:
            _check_row_offsets(o)
        offsets = [_as_buffer(o) for o in offsets]
    num_devices = num_replicas * devices_per_replica
    if len(offsets) == num_devices:
        return offsets
    if len(offsets) == num_replicas:
        return [o for o in offsets for _ in range(devices_per_replica)]
    raise ValueError(
        f"input_row_offsets has {len(offsets)} entries; expected one per replica "
        f"({num_replicas}) or per device ({num_devices})"
    )


def _as_buffer(offsets: Any) -> Any:
    """A numpy array of offsets as a uint32 Buffer; anything else as it is."""
    if isinstance(offsets, np.ndarray):
        return Buffer.from_numpy(np.ascontiguousarray(offsets, dtype=np.uint32))
    return offsets


def _split_by_replica(offsets: Any, splits: Any, num_replicas: int) -> list[Buffer]:
    """Replica r's rows of the global `offsets`: entries `splits[r] .. splits[r + 1]`
    (a view; its first entry need not be 0, since only differences are used).

    `splits` is read on the host (MAX's `get_data_parallel_splits` builds it there);
    ValueError unless it has `num_replicas + 1` non-decreasing entries from 0 to the
    batch size that `offsets` describes."""
    if isinstance(splits, Buffer):
        splits = splits.to_numpy() if splits.device.is_host else splits.to(CPU()).to_numpy()
    splits = np.asarray(splits)
    batch_size = int(offsets.shape[0]) - 1
    if (
        splits.shape != (num_replicas + 1,)
        or not np.issubdtype(splits.dtype, np.integer)
        or splits[0] != 0
        or splits[-1] != batch_size
        or np.any(np.diff(splits) < 0)
    ):
        raise ValueError(
            f"data_parallel_splits must be {num_replicas + 1} non-decreasing ints from 0 to "
            f"the batch size {batch_size}, got {splits.tolist()}"
        )
    return [offsets[int(splits[r]) : int(splits[r + 1]) + 1] for r in range(num_replicas)]


def _check_row_offsets(offsets: Any) -> None:
    """TypeError/ValueError unless `offsets` are integral, one-dimensional and
    non-decreasing from 0 (checked for numpy arrays and host Buffers; a device Buffer is
    not read back)."""
    if isinstance(offsets, Buffer):
        if not offsets.device.is_host:
            return
        offsets = offsets.to_numpy()
    if not isinstance(offsets, np.ndarray):
        raise TypeError(
            f"input_row_offsets must be numpy arrays or Buffers, got {type(offsets).__name__}"
        )
    if not np.issubdtype(offsets.dtype, np.integer):
        raise TypeError(f"input_row_offsets must be integers, got dtype {offsets.dtype}")
    if (
        offsets.ndim != 1
        or offsets.size < 1
        or offsets[0] != 0
        or np.any(np.diff(offsets.astype(np.int64)) < 0)
    ):
        raise ValueError(
            "input_row_offsets must be a non-decreasing 1-D array starting at 0, "
            f"got {offsets.tolist()}"
        )


def row_offsets_for(
    kv_cache_inputs: Any, prev_model_inputs: Any, num_replicas: int, devices_per_replica: int
) -> list[Buffer]:
    """`row_offsets_per_device`, checked against `kv_cache_inputs` (one per device, as
    `fetch` returned them): one offsets array per device, one row per sequence plus one."""
    if not isinstance(kv_cache_inputs, (list, tuple)):
        raise TypeError(
            f"kv_cache_inputs must be the list fetch returned, got {type(kv_cache_inputs).__name__}"
        )
    offsets = row_offsets_per_device(prev_model_inputs, num_replicas, devices_per_replica)
    if len(kv_cache_inputs) != len(offsets):
        raise ValueError(f"got {len(kv_cache_inputs)} cache inputs for {len(offsets)} devices")
    for inputs, row_offsets in zip(kv_cache_inputs, offsets):
        check_batch_size(inputs.cache_lengths, row_offsets)
    return offsets


def check_batch_size(cache_lengths: Buffer, row_offsets: Buffer) -> None:
    """ValueError unless there is one row offset per sequence, plus one."""
    if row_offsets.shape[0] != cache_lengths.shape[0] + 1:
        raise ValueError(
            f"input_row_offsets has {row_offsets.shape[0]} entries for a batch of "
            f"{cache_lengths.shape[0]} sequences (expected {cache_lengths.shape[0] + 1})"
        )
