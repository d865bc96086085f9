"""The MLA decoder's weights (graphs/mla_decoder.py) as a Hugging Face DeepSeek-V2
checkpoint: `config.json` (model_type "deepseek_v2") and `model.safetensors`, written with
numpy only, which transformers' `DeepseekV2ForCausalLM` loads as the same model.

Two layouts differ. mokv's weights multiply from the right (`x @ W`), HF's `nn.Linear`
weights from the left, so every projection is transposed; and mokv's RoPE rotates halves
(pairs `(x[j], x[j + half])`) where DeepSeek-V2's rotates neighbours (pairs `(x[2j],
x[2j + 1])`, as complex numbers). Interleaving the RoPE outputs of the query and the
key projections (`[a_0, b_0, a_1, b_1, ...]` for halves `a`, `b`) makes HF's rotation of
them mokv's rotation in another order, and a query-key dot product does not see the
order. Every layer is dense (`first_k_dense_replace` = the layer count): the decoder has
no MoE.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .mla_decoder import MLADecoderConfig


def hf_config(config: MLADecoderConfig) -> dict:
    """DeepSeek-V2's `config.json` for `config` (no query compression, as V2-Lite)."""
    c = config
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "moe_intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_heads,
        "q_lora_rank": None,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "first_k_dense_replace": c.num_layers,
        "n_routed_experts": 1,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


def _interleave_rope_rows(w: np.ndarray, rope: int) -> np.ndarray:
    """`w`'s last `rope` rows (an HF weight: outputs by row) from halves to pairs."""
    half = rope // 2
    order = np.stack([np.arange(half), half + np.arange(half)], axis=1).reshape(-1)
    out = w.copy()
    out[-rope:] = w[-rope:][order]
    return out


def hf_state_dict(config: MLADecoderConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`weights` (`init_mla_weights` names) under DeepSeek-V2's names and layouts."""
    c, w = config, weights
    out = {"model.embed_tokens.weight": w["embed_tokens"], "model.norm.weight": w["final_norm"],
           "lm_head.weight": w["lm_head"].T}
    for i in range(c.num_layers):
        mine, theirs = f"layers.{i}.", f"model.layers.{i}."
        q = w[mine + "q_proj"].T.reshape(c.n_heads, c.q_head_dim, c.hidden_size)
        q = np.stack([_interleave_rope_rows(head, c.qk_rope_head_dim) for head in q])
        gate_up = w[mine + "w_gate_up"]
        out |= {
            theirs + "input_layernorm.weight": w[mine + "attn_norm"],
            theirs + "self_attn.q_proj.weight": q.reshape(-1, c.hidden_size),
            theirs + "self_attn.kv_a_proj_with_mqa.weight": _interleave_rope_rows(
                w[mine + "kv_a_proj"].T, c.qk_rope_head_dim),
            theirs + "self_attn.kv_a_layernorm.weight": w[mine + "kv_a_norm"],
            theirs + "self_attn.kv_b_proj.weight": w[mine + "kv_b_proj"].reshape(-1, c.kv_lora_rank),
            theirs + "self_attn.o_proj.weight": w[mine + "o_proj"].T,
            theirs + "post_attention_layernorm.weight": w[mine + "mlp_norm"],
            theirs + "mlp.gate_proj.weight": gate_up[:, : c.intermediate_size].T,
            theirs + "mlp.up_proj.weight": gate_up[:, c.intermediate_size :].T,
            theirs + "mlp.down_proj.weight": w[mine + "w_down"].T,
        }
    return {name: np.ascontiguousarray(a) for name, a in out.items()}


def write_hf_checkpoint(config: MLADecoderConfig, weights: dict[str, np.ndarray], path: Path) -> Path:
    """Writes `config.json` and `model.safetensors` (float32) of `weights` into `path`."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(config), indent=1))
    save_file(hf_state_dict(config, weights), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path
