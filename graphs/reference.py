"""A numpy forward pass of the same decoder: the ground truth for every cached run.

It recomputes the whole sequence from its tokens, with no cache and in float64, and
shares nothing with the graph but the config and the checkpoint. A cached MAX run
that matches it is correct independently of how the kernels, the managers or the
scheduler got there.
"""

from __future__ import annotations

import numpy as np

from .config import DecoderConfig, rope_table
from .weights import Weights


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Rotates `x` `[T, heads, d]` at positions `0..T-1`, pairing `x[i]` with `x[i + d/2]`."""
    half = x.shape[-1] // 2
    cos = table[: x.shape[0], None, :half]
    sin = table[: x.shape[0], None, half:]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal grouped-query attention: q `[T, H, d]`, k and v `[T, KVH, d]` -> `[T, H, d]`."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    t = q.shape[0]
    scores = np.where(np.tril(np.ones((t, t), dtype=bool)), scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)


def reference_logits(config: DecoderConfig, weights: Weights, tokens: np.ndarray) -> np.ndarray:
    """Logits `[len(tokens), vocab]` (float64) of every position of one sequence."""
    c = config
    w = {name: arr.astype(np.float64) for name, arr in weights.items()}
    table = rope_table(c).astype(np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.size > c.max_seq_len:
        raise ValueError(f"{tokens.size} tokens exceed max_seq_len={c.max_seq_len}")
    t = tokens.size
    h = w["model.embed_tokens.weight"][tokens]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        x = _rms_norm(h, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(t, c.n_heads, c.head_dim)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).reshape(t, c.n_kv_heads, c.head_dim)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(t, c.n_kv_heads, c.head_dim)
        attn = _attention(_rope(q, table), _rope(k, table), v, c.attention_scale)
        h = h + attn.reshape(t, c.q_size) @ w[p + "self_attn.o_proj.weight"].T
        x = _rms_norm(h, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        up = x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    h = _rms_norm(h, w["model.norm.weight"], c.rms_norm_eps)
    return h @ w["lm_head.weight"].T


def reference_generate(
    config: DecoderConfig, weights: Weights, prompt: np.ndarray, num_new_tokens: int
) -> np.ndarray:
    """Greedy continuation of `prompt`: `num_new_tokens` ids, each from a full recompute."""
    tokens = list(np.asarray(prompt, dtype=np.int64))
    for _ in range(num_new_tokens):
        tokens.append(int(np.argmax(reference_logits(config, weights, np.array(tokens))[-1])))
    return np.array(tokens[len(prompt):], dtype=np.int64)


def first_mismatch(
    config: DecoderConfig, weights: Weights, tokens: np.ndarray, prompt_len: int
) -> int | None:
    """Checks generated tokens against greedy decoding without a cache, in one pass.

    `tokens` is a prompt of `prompt_len` tokens followed by greedily generated ones.
    Feeding them all back in (teacher forcing), position `t` must predict token
    `t + 1` for every generated token; the sequences agree exactly when that holds.
    Returns the index (into the generated tokens) of the first disagreement, or None.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    predicted = reference_logits(config, weights, tokens[:-1])[prompt_len - 1 :].argmax(axis=1)
    wrong = np.flatnonzero(predicted != tokens[prompt_len:])
    return int(wrong[0]) if wrong.size else None
