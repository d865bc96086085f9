"""DecoderModel: the compiled decoder graph plus the host work around one step.

A step takes the contexts of a batch and the cache inputs their manager fetched for
them, packs the contexts' active tokens into the ragged layout of `decoder.py`, and
returns the logits of each context's last active token. Which tokens are active (a
prompt chunk, one decode token) is the scheduler's business, recorded in each
`TextContext`; the model only reads `ctx.next_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mokv
import numpy as np
from max.driver import CPU, Buffer, Device
from max.engine import InferenceSession
from max.graph import DeviceRef

from .config import DecoderConfig, rope_table
from .decoder import build_decoder_graph
from .weights import Weights, graph_weights, init_weights


def ragged_inputs(batch: Sequence[mokv.TextContext]) -> tuple[np.ndarray, np.ndarray]:
    """`(token_ids int64 [total_tokens], input_row_offsets uint32 [batch + 1])` of a batch."""
    chunks = [ctx.next_tokens for ctx in batch]
    offsets = np.zeros(len(batch) + 1, dtype=np.uint32)
    np.cumsum([len(t) for t in chunks], out=offsets[1:])
    return np.concatenate(chunks).astype(np.int64, copy=False), offsets


class DecoderModel:
    """The decoder compiled for one KV cache manager's inputs (one device).

    Args:
        config: model sizes.
        manager: the `mokv` manager whose caches the model reads and writes; its
            `input_symbols()` fix the graph's cache inputs and layout (paged or
            continuous).
        session: the InferenceSession that compiles and runs the graph.
        weights: a Hugging Face-named checkpoint (`weights.load_safetensors`), or None
            for `init_weights(config, seed=0)`.
        device: where the model runs; the manager's first device by default.

    The compiled graph fits any manager with the same `input_symbols()` (same params
    and layer count; for the continuous cache also the same `max_seq_len`): pass that
    manager's `fetch` result to `execute`.
    """

    def __init__(
        self,
        config: DecoderConfig,
        manager: Any,
        session: InferenceSession,
        weights: Weights | None = None,
        device: Device | None = None,
    ) -> None:
        self.config = config
        self.manager = manager
        self.device = device or manager.devices[0]
        (symbols,) = manager.input_symbols()  # one device: the model is not sharded
        self.graph = build_decoder_graph(
            config, manager.params, symbols, DeviceRef.from_device(self.device),
            name=f"mokv_decoder_{manager.layout.name}",
        )
        registry = graph_weights(config, weights if weights is not None else init_weights(config))
        registry["rope.freqs_cis"] = rope_table(config)
        # The session keeps views of these arrays; hold them as long as the model lives.
        self._registry = registry
        with mokv.filter_collection_warnings():  # MAX's generated code moves them needlessly
            self.model = session.load(self.graph, weights_registry=registry)

    def execute(
        self, batch: Sequence[mokv.TextContext], cache_inputs: Sequence[Any]
    ) -> np.ndarray:
        """Logits float32 `[len(batch), vocab]` of each context's last active token.

        Writes the active tokens' K and V into the cache; `cache_inputs` is what
        `manager.fetch(batch)` returned for exactly this batch, in this order.
        """
        token_ids, offsets = ragged_inputs(batch)
        args = [Buffer.from_numpy(token_ids), Buffer.from_numpy(offsets)]
        if not self.device.is_host:
            args = [a.to(self.device) for a in args]
        (device_inputs,) = cache_inputs
        (logits,) = self.model.execute(*args, *device_inputs)
        return logits.to_numpy() if self.device.is_host else logits.to(CPU()).to_numpy()

    def step(self, batch: Sequence[mokv.TextContext]) -> np.ndarray:
        """Fetches the batch's cache inputs and runs it: `execute(batch, manager.fetch(batch))`.

        Every context must be claimed (and, for the paged cache, should be reserved
        with `maybe_reserve`, else `fetch` reserves it or raises).
        """
        return self.execute(batch, self.manager.fetch(batch))
