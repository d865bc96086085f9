"""A DeepSeek-V2-Lite-shaped decoder whose attention is MLA on a mokv MLA cache.

Each layer is DeepSeek V2's multi-head latent attention (no query compression, as in
V2-Lite) and a dense SwiGLU MLP (V2-Lite's MoE layers are left out: the cache only
meets attention):

    q            = x W_q                      [tokens, heads, nope + rope]
    [c ; r]      = x W_kv_a                   [tokens, kv_lora_rank + rope]
    c            = rms_norm(c)                the latent the cache holds, with rope(r)
    k_h, v_h     = c W_kv_b,h                 (never built: absorbed)
    out          = sum_h attention_h W_o

The graph runs the absorbed form (mokv.ops.mla_attention): the query's nope part goes
through each head's key up-projection, the attention returns latents, each head's value
up-projection follows. `mla_reference_logits` is the same model un-absorbed, in numpy
float64 and without a cache, the tests' ground truth.

    token_ids          int64  [total_tokens]
    positions          int64  [total_tokens]   each token's position in its sequence
    input_row_offsets  uint32 [batch_size + 1]
    *cache inputs      max.tree.leaves(manager.max_input_symbols()[0])
    -> logits          float32 [batch_size, vocab_size], of each sequence's last row
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mokv
import numpy as np
from max import tree
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, TensorValue, Weight, ops
from mokv import ops as mokv_ops


@dataclass(frozen=True)
class MLADecoderConfig:
    """DeepSeek-V2-Lite's shape at small sizes (V2-Lite: hidden 2048, 16 heads of 128 +
    64, values of 128, a latent of 512, 27 layers)."""

    vocab_size: int = 64
    hidden_size: int = 64
    n_heads: int = 4
    qk_nope_head_dim: int = 16
    """Each head's query and key width outside RoPE (V2-Lite: 128)."""
    qk_rope_head_dim: int = 16
    """The RoPE part of a query head, and the one RoPE key all heads share (64)."""
    v_head_dim: int = 16
    """Each head's value width, the output of its value up-projection (128)."""
    kv_lora_rank: int = 32
    """The latent's width, the cache's row less the RoPE key (512)."""
    intermediate_size: int = 96
    """The dense MLP's width (V2-Lite's first layer: 10944)."""
    num_layers: int = 2
    """Layers, every one MLA with a dense MLP (V2-Lite: 27, MoE from the second)."""
    max_seq_len: int = 128
    """Positions the RoPE tables cover."""
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return float(self.q_head_dim**-0.5)

    def cache_group(self) -> mokv.CacheGroupConfig:
        """The model's MLA cache group (every layer)."""
        return mokv.CacheGroupConfig(
            "mla", self.num_layers, latent_dim=self.kv_lora_rank, rope_dim=self.qk_rope_head_dim
        )

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self
        shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (c.vocab_size, c.hidden_size)}
        for i in range(c.num_layers):
            shapes |= {
                f"layers.{i}.attn_norm": (c.hidden_size,),
                f"layers.{i}.q_proj": (c.hidden_size, c.n_heads * c.q_head_dim),
                f"layers.{i}.kv_a_proj": (c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim),
                f"layers.{i}.kv_a_norm": (c.kv_lora_rank,),
                f"layers.{i}.kv_b_proj": (
                    c.n_heads,
                    c.qk_nope_head_dim + c.v_head_dim,
                    c.kv_lora_rank,
                ),
                f"layers.{i}.o_proj": (c.n_heads * c.v_head_dim, c.hidden_size),
                f"layers.{i}.mlp_norm": (c.hidden_size,),
                f"layers.{i}.w_gate_up": (c.hidden_size, 2 * c.intermediate_size),
                f"layers.{i}.w_down": (c.intermediate_size, c.hidden_size),
            }
        return shapes | {"final_norm": (c.hidden_size,), "lm_head": (c.hidden_size, c.vocab_size)}


def init_mla_weights(config: MLADecoderConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights (norms near 1, projections scaled by fan-in)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in config.weight_shapes().items():
        if name.endswith("norm"):
            weights[name] = 1 + 0.1 * rng.standard_normal(shape)
        else:
            weights[name] = rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)
    return {name: w.astype(np.float32) for name, w in weights.items()}


def rope_tables(config: MLADecoderConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin `[max_seq_len, rope / 2]` (rotate-half RoPE)."""
    half = config.qk_rope_head_dim // 2
    inv = config.rope_theta ** (-np.arange(half, dtype=np.float64) / half)
    angles = np.arange(config.max_seq_len)[:, None] * inv[None, :]
    return np.cos(angles), np.sin(angles)


class _Builder:
    def __init__(self, config: MLADecoderConfig, device: DeviceRef) -> None:
        self.c, self.device = config, device
        self.shapes = config.weight_shapes()

    def w(self, name: str) -> Weight:
        return Weight(name, DType.float32, list(self.shapes[name]), device=self.device)

    def norm(self, x: TensorValue, name: str) -> TensorValue:
        return ops.rms_norm(x, self.w(name), self.c.rms_norm_eps)

    def rope(self, x: TensorValue, cos: TensorValue, sin: TensorValue) -> TensorValue:
        """Rotate-half RoPE of `x` [tokens, ..., rope] with per-token cos/sin [tokens, rope/2]
        broadcast over the middle dims."""
        half = self.c.qk_rope_head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return ops.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def attention(self, i, h, cache, offsets, cos, sin) -> TensorValue:
        c = self.c
        x = self.norm(h, f"layers.{i}.attn_norm")
        q = ops.reshape(x @ self.w(f"layers.{i}.q_proj"), [-1, c.n_heads, c.q_head_dim])
        q_nope, q_rope = q[:, :, : c.qk_nope_head_dim], q[:, :, c.qk_nope_head_dim :]
        q_rope = self.rope(q_rope, ops.unsqueeze(cos, 1), ops.unsqueeze(sin, 1))
        kv_a = x @ self.w(f"layers.{i}.kv_a_proj")
        latent = self.norm(kv_a[:, : c.kv_lora_rank], f"layers.{i}.kv_a_norm")
        k_rope = self.rope(kv_a[:, c.kv_lora_rank :], cos, sin)
        mokv_ops.mla_store(cache, latent, k_rope, offsets, i)
        kv_b = self.w(f"layers.{i}.kv_b_proj")  # [heads, nope + v, latent]
        w_uk, w_uv = kv_b[:, : c.qk_nope_head_dim, :], kv_b[:, c.qk_nope_head_dim :, :]
        # Absorbed: each head's query through its key up-projection, into latent space.
        q_latent = ops.permute(ops.permute(q_nope, [1, 0, 2]) @ w_uk, [1, 0, 2])
        q_abs = ops.concat([q_latent, q_rope], axis=2)
        o = mokv_ops.mla_attention(cache, q_abs, offsets, i, c.scale, c.qk_rope_head_dim)
        v = ops.permute(ops.permute(o, [1, 0, 2]) @ ops.permute(w_uv, [0, 2, 1]), [1, 0, 2])
        return h + ops.reshape(v, [-1, c.n_heads * c.v_head_dim]) @ self.w(f"layers.{i}.o_proj")

    def mlp(self, i: int, h: TensorValue) -> TensorValue:
        c = self.c
        x = self.norm(h, f"layers.{i}.mlp_norm")
        gate_up = x @ self.w(f"layers.{i}.w_gate_up")
        gate, up = gate_up[:, : c.intermediate_size], gate_up[:, c.intermediate_size :]
        return h + (ops.silu(gate) * up) @ self.w(f"layers.{i}.w_down")


def build_mla_decoder_graph(
    config: MLADecoderConfig, cache_symbols: object, device: DeviceRef | None = None
) -> Graph:
    """The decoder graph on one device's MLA cache inputs (`cache_symbols`: one entry of
    `manager.max_input_symbols()`); weights by `weight_shapes` names, plus `rope.cos`
    and `rope.sin`."""
    cache_types = tree.leaves(cache_symbols)
    device = device or cache_types[0].device
    input_types = [
        TensorType(DType.int64, ["total_tokens"], device=device),
        TensorType(DType.int64, ["total_tokens"], device=device),
        TensorType(DType.uint32, ["input_row_offsets_len"], device=device),
        *cache_types,
    ]
    c = config
    with Graph("mokv_mla_decoder", input_types=input_types) as graph:
        token_ids, positions, offsets = (v.tensor for v in graph.inputs[:3])
        cache = mokv.max_cache_values(graph.inputs[3:])
        b = _Builder(c, device)
        half = [c.max_seq_len, c.qk_rope_head_dim // 2]
        cos = ops.gather(Weight("rope.cos", DType.float32, half, device=device), positions, 0)
        sin = ops.gather(Weight("rope.sin", DType.float32, half, device=device), positions, 0)
        h = ops.gather(b.w("embed_tokens"), token_ids, axis=0)
        for i in range(c.num_layers):
            h = b.mlp(i, b.attention(i, h, cache, offsets, cos, sin))
        last_rows = ops.cast(offsets[1:] - 1, DType.int64)
        h = b.norm(ops.gather(h, last_rows, axis=0), "final_norm")
        graph.output(h @ b.w("lm_head"))
    return graph


def mla_reference_logits(
    config: MLADecoderConfig, weights: dict[str, np.ndarray], tokens: Sequence[int]
) -> np.ndarray:
    """The last token's logits of `tokens`, un-absorbed (keys and values built per head),
    numpy float64, no cache."""
    c = config
    w = {name: a.astype(np.float64) for name, a in weights.items()}
    cos, sin = rope_tables(c)
    n = len(tokens)
    cos, sin = cos[:n], sin[:n]

    def norm(x, name):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_norm_eps) * w[name]

    def rope(x, cs, sn):
        half = c.qk_rope_head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cs - x2 * sn, x2 * cs + x1 * sn], axis=-1)

    h = w["embed_tokens"][np.asarray(tokens)]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(c.num_layers):
        x = norm(h, f"layers.{i}.attn_norm")
        q = (x @ w[f"layers.{i}.q_proj"]).reshape(n, c.n_heads, c.q_head_dim)
        q_nope, q_rope = q[..., : c.qk_nope_head_dim], rope(q[..., c.qk_nope_head_dim :], cos[:, None], sin[:, None])
        kv_a = x @ w[f"layers.{i}.kv_a_proj"]
        latent = norm(kv_a[:, : c.kv_lora_rank], f"layers.{i}.kv_a_norm")
        k_rope = rope(kv_a[:, c.kv_lora_rank :], cos, sin)
        kv_b = w[f"layers.{i}.kv_b_proj"]
        k_nope = np.einsum("hdc,tc->thd", kv_b[:, : c.qk_nope_head_dim], latent)
        v = np.einsum("hdc,tc->thd", kv_b[:, c.qk_nope_head_dim :], latent)
        scores = (np.einsum("qhd,khd->hqk", q_nope, k_nope) + np.einsum("qhd,kd->hqk", q_rope, k_rope)) * c.scale
        p = np.exp(scores + mask - (scores + mask).max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", p, v).reshape(n, -1)
        h = h + attn @ w[f"layers.{i}.o_proj"]
        x = norm(h, f"layers.{i}.mlp_norm")
        gate_up = x @ w[f"layers.{i}.w_gate_up"]
        gate, up = gate_up[:, : c.intermediate_size], gate_up[:, c.intermediate_size :]
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w[f"layers.{i}.w_down"]
    return norm(h[-1], "final_norm") @ w["lm_head"]
