"""DecoderConfig: the shape of the Llama-style decoder, and the cache shape it implies.

One frozen config flows into the weights, the numpy reference, the MAX graph and the
KV cache parameters, so the four cannot disagree about a size. The defaults give a
model small enough to compile and run in seconds on two CPU cores.
"""

from __future__ import annotations

from dataclasses import dataclass

import mokv
import numpy as np
from max.dtype import DType
from mokv.ops import rope_freqs_cis

from .rope import Llama3RopeScaling, inverse_frequencies


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes of a Llama-style decoder (grouped-query attention, SwiGLU MLP, RMSNorm, RoPE).

    Attributes:
        vocab_size: rows of the token embedding and of the LM head.
        hidden_size: width of the residual stream.
        num_layers: transformer blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads; each serves `n_heads // n_kv_heads` query heads.
        head_dim: size of one head's vector (even: RoPE rotates pairs).
        intermediate_size: width of the SwiGLU MLP.
        max_seq_len: longest sequence the RoPE table (and the cache) covers.
        rope_theta: RoPE base frequency.
        rms_norm_eps: epsilon inside every RMSNorm.
        rope_scaling: Llama 3.1's long-context rescaling of the RoPE frequencies, or
            None for plain RoPE.
    """

    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    rope_scaling: Llama3RopeScaling | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size", "hidden_size", "num_layers", "n_heads", "n_kv_heads",
            "head_dim", "intermediate_size", "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise TypeError(
                f"rope_scaling must be a Llama3RopeScaling or None, got {self.rope_scaling!r}"
            )

    @property
    def q_size(self) -> int:
        """Columns of Q: `n_heads * head_dim`."""
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Columns of K (and of V): `n_kv_heads * head_dim`."""
        return self.n_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """Softmax scale `1 / sqrt(head_dim)`."""
        return 1.0 / float(np.sqrt(self.head_dim))

    def kv_params(
        self, strategy: str | mokv.KVCacheStrategy = "paged", page_size: int = 16,
        enable_prefix_caching: bool = True,
    ) -> mokv.KVCacheParams:
        """The `mokv.KVCacheParams` of this model's cache (float32, one device).

        Prefix caching only applies to the paged strategy; the continuous cache
        never shares memory between requests, so it is turned off there.
        """
        strategy = mokv.KVCacheStrategy(strategy)
        return mokv.KVCacheParams(
            dtype=DType.float32,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            page_size=page_size,
            cache_strategy=strategy,
            enable_prefix_caching=enable_prefix_caching and strategy is mokv.KVCacheStrategy.PAGED,
        )


TINY_LLAMA = DecoderConfig(
    vocab_size=256, hidden_size=64, num_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
    intermediate_size=128, max_seq_len=1024,
)
"""The model `make serve`, the server tests and the serving benchmark run through MAX's own
pipeline on the CPU (`checkpoint.tiny_llama_checkpoint`): one shape everywhere, so that
MAX compiles it once per machine."""


def rope_table(config: DecoderConfig) -> np.ndarray:
    """float32 `[max_seq_len, head_dim]`: `(cos θ_0..θ_{d/2-1}, sin θ_0..θ_{d/2-1})` per position.

    `θ_i(pos) = pos * f_i` with `f_i = rope_theta ** (-2i / head_dim)`, rescaled by
    `config.rope_scaling` if set (`rope.py`). This is the `freqs_cis` layout of mokv's
    fused QKV op, which rotates the pairs `(x[i], x[i + d/2])` ("rotate half", as
    Hugging Face Llama checkpoints expect). The graph and the numpy reference both
    read this one table.
    """
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    return rope_freqs_cis(config.head_dim, config.max_seq_len, inv_freq=inv_freq)
