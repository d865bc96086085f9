"""The Llama-style decoder as one MAX graph whose attention runs through a mokv cache.

One step of the graph processes a ragged batch: every sequence contributes the tokens
it feeds this step (a prompt chunk, or one token while decoding), all of them stacked
in one flat array:

    token_ids          int64  [total_tokens]    seq 0's tokens, then seq 1's, ...
    input_row_offsets  uint32 [batch_size + 1]  seq b owns rows offsets[b]:offsets[b+1]
    *cache inputs      the manager's `input_symbols()` for one device, flattened
                       (its layout's `Inputs`: paged or continuous)
    -> logits          float32 [batch_size, vocab_size], of each sequence's LAST row

Positions are not an input: the fused QKV op places row `i` of sequence `b` at
`cache_lengths[b] + i`, writes its K and V there and rotates Q and K for that
position; attention then sees the cached prefix plus the new rows, causally.

The graph is the same for every cache layout; the layout of the input symbols
decides which op turns the flat cache inputs into the opaque collection.
"""

from __future__ import annotations

from collections.abc import Sequence

import mokv
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, TensorValue, Weight, ops
from mokv import ops as mokv_ops

from .config import DecoderConfig


class _DecoderBuilder:
    """Emits the decoder's ops into the current graph; one method per block."""

    def __init__(self, config: DecoderConfig, device: DeviceRef) -> None:
        self.c = config
        self.device = device

    def weight(self, name: str, shape: Sequence[int]) -> Weight:
        return Weight(name, DType.float32, list(shape), device=self.device)

    def rms_norm(self, x: TensorValue, name: str) -> TensorValue:
        return ops.rms_norm(x, self.weight(name, [self.c.hidden_size]), self.c.rms_norm_eps)

    def attention(
        self, i: int, h: TensorValue, kv: object, offsets: TensorValue, freqs_cis: TensorValue
    ) -> TensorValue:
        """Pre-norm GQA block: fused QKV (+RoPE, K/V into the cache), flash attention, o_proj."""
        c = self.c
        x = self.rms_norm(h, f"layers.{i}.attn_norm")
        wqkv = self.weight(f"layers.{i}.wqkv", [c.q_size + 2 * c.kv_size, c.hidden_size])
        q = mokv_ops.fused_qkv_matmul(kv, x, wqkv, offsets, i, c.n_heads, freqs_cis=freqs_cis)
        q = ops.reshape(q, [-1, c.n_heads, c.head_dim])
        attn = mokv_ops.flash_attention(kv, q, offsets, i, scale=c.attention_scale)
        attn = ops.reshape(attn, [-1, c.q_size])
        return h + attn @ self.weight(f"layers.{i}.wo", [c.q_size, c.hidden_size])

    def mlp(self, i: int, h: TensorValue) -> TensorValue:
        """Pre-norm SwiGLU: `down(silu(gate(x)) * up(x))`, gate and up in one matmul."""
        c = self.c
        x = self.rms_norm(h, f"layers.{i}.mlp_norm")
        gate_up = x @ self.weight(f"layers.{i}.w_gate_up", [c.hidden_size, 2 * c.intermediate_size])
        gate, up = gate_up[:, : c.intermediate_size], gate_up[:, c.intermediate_size :]
        down = self.weight(f"layers.{i}.w_down", [c.intermediate_size, c.hidden_size])
        return h + (ops.silu(gate) * up) @ down


def build_decoder_graph(
    config: DecoderConfig,
    kv_params: mokv.KVCacheParams,
    cache_input_types: tuple[object, ...],
    device: DeviceRef | None = None,
    name: str = "mokv_decoder",
) -> Graph:
    """Builds the decoder graph for one device's cache inputs.

    Args:
        config: model sizes; `config.num_layers` layers are read from the cache.
        kv_params: the cache's params.
        cache_input_types: one device's entry of `manager.input_symbols()` (its
            layout's `Inputs` tuple, which picks the fetch op).
        device: where tokens, weights and activations live (default: the device of
            the cache blocks).
        name: graph name (compiled-graph caches key on it, with the signature).

    The graph's weights are `max.graph.Weight`s named as in `weights.graph_weights`,
    plus `rope.freqs_cis` (`config.rope_table`); bind them with
    `session.load(graph, weights_registry=...)`.
    """
    c = config
    if kv_params.n_kv_heads_per_device != c.n_kv_heads or kv_params.head_dim != c.head_dim:
        raise ValueError(
            f"cache holds {kv_params.n_kv_heads_per_device} KV heads of {kv_params.head_dim} "
            f"per device; the model has {c.n_kv_heads} of {c.head_dim}"
        )
    layout = mokv.layout_of_inputs(cache_input_types)
    device = device or cache_input_types.blocks.device  # type: ignore[attr-defined]
    input_types = [
        TensorType(DType.int64, ["total_tokens"], device=device),
        TensorType(DType.uint32, ["input_row_offsets_len"], device=device),
        *cache_input_types,
    ]
    with Graph(name, input_types=input_types) as graph:
        token_ids, offsets = graph.inputs[0].tensor, graph.inputs[1].tensor
        b = _DecoderBuilder(c, device)
        freqs_cis = b.weight("rope.freqs_cis", [c.max_seq_len, c.head_dim])
        h = ops.gather(b.weight("embed_tokens", [c.vocab_size, c.hidden_size]), token_ids, axis=0)
        kv = layout.fetch(kv_params, c.num_layers, *graph.inputs[2:])
        for i in range(c.num_layers):
            h = b.attention(i, h, kv, offsets, freqs_cis)
            h = b.mlp(i, h)
        # Only each sequence's last row predicts a token: gather those before the final
        # norm and the LM head, the two largest per-row costs after the layers.
        last_rows = ops.cast(offsets[1:] - 1, DType.int64)
        h = b.rms_norm(ops.gather(h, last_rows, axis=0), "final_norm")
        logits = h @ b.weight("lm_head", [c.hidden_size, c.vocab_size])
        graph.output(ops.cast(logits, DType.float32))
    return graph
