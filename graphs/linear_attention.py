"""A small gated linear-attention layer stack in numpy float64, reading and writing its
state through MAX's recurrent-state inputs (`RecurrentLeafInputs`: a region's pool and
each layer's live rows), as a kernel of MAX's Qwen3.5 or Nemotron-H does.

MAX 26.7's Qwen3.5 pipeline does not run on the CPU (its linear-attention blocks build
an `Allreduce` over GPUs whatever the devices: docs/recurrent.md), so this is what the
tests run mokv's state group (`mokv.managers.paged.groups.state`) and its checkpoints
against: a prompt resumed from a checkpoint gives the same outputs and states as one
computed from its first token (float64: every op is the same, in the same order).

Per layer and token `t`, with embeddings `q, k, v` of `t` (one row per head), a gate
`g` of `t` in (0, 1) and a causal conv of width `CONV + 1` over `v`:

    conv state  the last CONV values of v            [heads * head_dim, CONV]
    vc          w[0] * v + sum_i w[i + 1] * conv[:, i]
    S           g * S + outer(k, vc), per head       [heads, head_dim, head_dim]
    out         q @ S                                [heads, head_dim]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from max.dtype import DType
from max.nn.kv_cache import RecurrentLeafInputs
from mokv import StateRegion

CONV = 3
"""Past values the causal conv reads (a kernel of width 4, as Qwen3.5's)."""


class LinearAttentionStack:
    """`num_layers` gated linear-attention layers with random float64 weights."""

    def __init__(self, vocab_size: int, num_layers: int, heads: int, head_dim: int, seed: int):
        rng = np.random.default_rng(seed)
        shape = (num_layers, vocab_size, heads, head_dim)
        self.q, self.k, self.v = (rng.standard_normal(shape) / head_dim for _ in range(3))
        self.gate = rng.uniform(0.5, 0.99, (num_layers, vocab_size, heads))
        self.conv_weight = rng.standard_normal((num_layers, CONV + 1))
        self.num_layers, self.heads, self.head_dim = num_layers, heads, head_dim

    def regions(self) -> tuple[StateRegion, StateRegion]:
        """The stack's state: its conv region, then its matrix region (float64)."""
        width = self.heads * self.head_dim
        return (
            StateRegion("conv", self.num_layers, (width, CONV), DType.float64),
            StateRegion("ssm", self.num_layers, (self.heads, self.head_dim, self.head_dim),
                        DType.float64),
        )

    def zero_state(self) -> tuple[np.ndarray, np.ndarray]:
        """A request's state before its first token: `[layers, *row_shape]` per region."""
        conv, ssm = self.regions()
        return (np.zeros((self.num_layers, *conv.row_shape)),
                np.zeros((self.num_layers, *ssm.row_shape)))

    def step(self, conv: np.ndarray, ssm: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
        """Runs `tokens` from the state `(conv, ssm)` (`[layers, ...]`, updated in place);
        returns the outputs, `[len(tokens), layers, heads, head_dim]`."""
        out = np.empty((len(tokens), self.num_layers, self.heads, self.head_dim))
        for layer in range(self.num_layers):
            w = self.conv_weight[layer]
            for i, t in enumerate(tokens):
                v = self.v[layer, t].reshape(-1)
                vc = (w[0] * v + conv[layer] @ w[1:]).reshape(self.heads, self.head_dim)
                conv[layer] = np.concatenate([v[:, None], conv[layer][:, :-1]], axis=1)
                g = self.gate[layer, t][:, None, None]
                ssm[layer] = g * ssm[layer] + self.k[layer, t][:, :, None] * vc[:, None, :]
                out[i, layer] = np.einsum("hd,hde->he", self.q[layer, t], ssm[layer])
        return out

    def run(
        self, leaves: Sequence[RecurrentLeafInputs], batch: Sequence[Sequence[int]]
    ) -> list[np.ndarray]:
        """One step of a batch on a CPU cache's state inputs (conv, then ssm: the
        `regions` order): each request's tokens from the state in its live rows, which
        the step overwrites, as a model step does. Returns each request's outputs."""
        conv_pool, ssm_pool = (leaf.pool.to_numpy() for leaf in leaves)  # the cache's memory
        conv_rows, ssm_rows = (leaf.live_row_ids.to_numpy() for leaf in leaves)
        outputs = []
        for b, tokens in enumerate(batch):
            conv, ssm = conv_pool[conv_rows[:, b]], ssm_pool[ssm_rows[:, b]]  # copies
            outputs.append(self.step(conv, ssm, tokens))
            conv_pool[conv_rows[:, b]], ssm_pool[ssm_rows[:, b]] = conv, ssm
        return outputs
