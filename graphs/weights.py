"""Decoder weights: deterministic random init, safetensors files, and the graph's layout.

Checkpoint names and layouts follow Hugging Face Llama (`model.layers.0.self_attn.q_proj.weight`,
`[out_features, in_features]`), so the weights of any real model of this architecture
load unchanged, and a checkpoint with tensors the decoder would not use is refused
(`check_weights`). `graph_weights` then rearranges them once, on the host, into what the
graph multiplies by: Q, K and V stacked for mokv's fused QKV op, the other projections
transposed to `[in, out]` (so no transpose runs per step), gate and up fused into one
matmul.

Files are written with a 20-line writer (the safetensors format is a JSON header plus raw
little-endian bytes) and read with MAX's own `max.graph.weights.SafetensorWeights`, so
neither direction needs the `safetensors` package.
"""

from __future__ import annotations

import json
import re
import struct
from os import PathLike

import numpy as np
from max.dtype import DType
from max.graph.weights import SafetensorWeights

from .config import DecoderConfig

Weights = dict[str, np.ndarray]
"""Checkpoint tensors by Hugging Face Llama name, float32 numpy arrays."""

_ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}

IGNORED_TENSORS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
"""Checkpoint tensors the decoder may leave unused: older transformers versions saved
each layer's RoPE inverse frequencies as a buffer, which transformers itself recomputes
from the config when it loads them (as mokv does, `config.rope_table`)."""


def checkpoint_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor name with its shape (`[out_features, in_features]`)."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (c.q_size, c.hidden_size),
            p + "self_attn.k_proj.weight": (c.kv_size, c.hidden_size),
            p + "self_attn.v_proj.weight": (c.kv_size, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, c.q_size),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
    shapes["model.norm.weight"] = (c.hidden_size,)
    shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def init_weights(config: DecoderConfig, seed: int = 0) -> Weights:
    """Deterministic random weights: the same `(config, seed)` always gives the same model.

    Projections are N(0, 1/fan_in), which keeps activations near unit scale through
    the layers. Norm weights are near 1 but not exactly, so a test notices a norm
    whose weight is ignored. The LM head is scaled up so that the top two logits are
    usually far apart: greedy decoding then does not flip on float rounding, and
    cached and uncached runs can be compared token for token.
    """
    rng = np.random.default_rng(seed)
    weights: Weights = {}
    for name, shape in checkpoint_shapes(config).items():
        if len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
            if name == "lm_head.weight":
                w *= 4.0
        weights[name] = w.astype(np.float32)
    return weights


def check_weights(config: DecoderConfig, weights: Weights) -> None:
    """Raises ValueError naming the first missing or misshapen tensor, or the unused ones.

    A tensor the decoder would not read (a bias, another architecture's layer, a layer
    past `num_layers`) means the checkpoint is not the model the config describes, and
    ignoring it would give silently wrong logits; only `IGNORED_TENSORS` may be left over.
    """
    shapes = checkpoint_shapes(config)
    for name, shape in shapes.items():
        if name not in weights:
            raise ValueError(f"weight {name!r} is missing (expected shape {shape})")
        if tuple(weights[name].shape) != shape:
            raise ValueError(
                f"weight {name!r} has shape {tuple(weights[name].shape)}, expected {shape}"
            )
    unused = sorted(n for n in weights if n not in shapes and not IGNORED_TENSORS.fullmatch(n))
    if unused:
        shown = ", ".join(repr(n) for n in unused[:20])
        more = f" and {len(unused) - 20} more" if len(unused) > 20 else ""
        biases = any(n.endswith(".bias") for n in unused)
        hint = " (the decoder has no biases: mokv's fused QKV kernel adds none)" if biases else ""
        raise ValueError(
            f"{len(unused)} checkpoint tensors are not used by the decoder: {shown}{more}{hint}"
        )


def save_safetensors(
    path: str | PathLike[str], weights: Weights, dtype: str | None = None
) -> None:
    """Writes float32/float16 arrays as a safetensors file (header, then raw bytes); with
    `dtype="bfloat16"` every tensor is stored as bfloat16 (rounded to nearest, ties to
    even: how checkpoints are cast), the dtype of MAX's GPU pipelines."""
    header: dict[str, object] = {}
    offset = 0
    arrays = []
    for name in sorted(weights):
        arr = np.ascontiguousarray(weights[name])
        if arr.dtype not in _ST_DTYPES:
            raise ValueError(f"weight {name!r}: dtype {arr.dtype} is not float32 or float16")
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        st_dtype = _ST_DTYPES[arr.dtype]
        if dtype == "bfloat16":
            arr, st_dtype = _bfloat16_bits(arr), "BF16"
        elif dtype is not None:
            raise ValueError(f"dtype must be None or 'bfloat16', got {dtype!r}")
        header[name] = {
            "dtype": st_dtype,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        arrays.append(arr)
        offset += arr.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())


def _bfloat16_bits(arr: np.ndarray) -> np.ndarray:
    """The bfloat16 bit patterns (little-endian uint16) nearest to `arr`'s values, ties to
    even (finite values; bfloat16 is float32's top half)."""
    bits = arr.astype("<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2")


def read_safetensors(path: str | PathLike[str]) -> Weights:
    """Every tensor of one safetensors file as float32 arrays, read with MAX's reader.

    bfloat16 and float16 tensors (the usual dtypes of real checkpoints) are widened
    to float32. Nothing is checked or added: this reads one shard of a checkpoint.
    """
    st = SafetensorWeights([path])
    weights: Weights = {}
    for name, entry in st.items():
        buffer = entry.data().to_buffer()
        if buffer.dtype == DType.bfloat16:
            bits = buffer.view(DType.uint16).to_numpy().astype(np.uint32) << 16
            weights[name] = bits.view(np.float32)
        else:
            weights[name] = np.array(buffer.to_numpy(), dtype=np.float32)
    st.close()
    return weights


def load_safetensors(path: str | PathLike[str], config: DecoderConfig | None = None) -> Weights:
    """Reads a one-file checkpoint (`read_safetensors`); a directory: `load_checkpoint`.

    A checkpoint without `lm_head.weight` has tied embeddings: the LM head reuses
    `model.embed_tokens.weight`. With `config`, `check_weights` runs (shapes, and no
    unused tensors).
    """
    weights = read_safetensors(path)
    if "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    if config is not None:
        check_weights(config, weights)
    return weights


def graph_weights(config: DecoderConfig, weights: Weights) -> Weights:
    """The graph's weight registry, rearranged from a checkpoint (names in `decoder.py`).

    - `layers.{i}.wqkv`     `[(n_heads + 2 * n_kv_heads) * head_dim, hidden]`: Q, K, V
                            rows stacked, the fused QKV op's layout;
    - `layers.{i}.wo`       `[q_size, hidden]` (o_proj transposed);
    - `layers.{i}.w_gate_up` `[hidden, 2 * intermediate]`: gate then up, transposed;
    - `layers.{i}.w_down`   `[intermediate, hidden]`;
    - `lm_head`             `[hidden, vocab]`; norms and the embedding as they are.
    """
    check_weights(config, weights)
    out: Weights = {
        "embed_tokens": weights["model.embed_tokens.weight"],
        "final_norm": weights["model.norm.weight"],
        "lm_head": weights["lm_head.weight"].T,
    }
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        out |= {
            f"layers.{i}.attn_norm": weights[p + "input_layernorm.weight"],
            f"layers.{i}.wqkv": np.concatenate(
                [weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"], axis=0
            ),
            f"layers.{i}.wo": weights[p + "self_attn.o_proj.weight"].T,
            f"layers.{i}.mlp_norm": weights[p + "post_attention_layernorm.weight"],
            f"layers.{i}.w_gate_up": np.concatenate(
                [weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]], axis=0
            ).T,
            f"layers.{i}.w_down": weights[p + "mlp.down_proj.weight"].T,
        }
    return {name: np.ascontiguousarray(w, dtype=np.float32) for name, w in out.items()}
