"""Hugging Face checkpoint directories: `config.json` -> DecoderConfig, safetensors -> Weights.

    config, weights = load_checkpoint("Llama-3.2-1B/")
    model = DecoderModel(config, manager, session, weights)
    save_checkpoint("tiny/", config, weights)   # the inverse, with a word-level tokenizer

`save_checkpoint` writes a directory that MAX's own pipelines and `max serve` load as a
`LlamaForCausalLM` (float32 weights run on MAX's CPU path): how the tests and `make
serve` get a model with no model hub.

A directory holds `config.json` and either `model.safetensors` or shards
`model-0000k-of-0000n.safetensors` listed by `model.safetensors.index.json`.

Accepted: `model_type` "llama" and "mistral" (without a sliding window shorter than the
context), SiLU MLPs, plain RoPE or Llama 3.1's `"llama3"` scaling, tied or separate
embeddings. Refused with a ValueError naming the key or tensor, because the decoder
would run but compute something else: other RoPE scalings ("linear", "dynamic", "yarn",
...), `attention_bias` / `mlp_bias` and bias tensors (mokv's fused QKV kernel writes K
and V into the cache itself, so no bias can be added after it), other activations, and
any tensor the decoder does not read. Qwen2 (`model_type` "qwen2") always has q/k/v
biases, so it is refused too.

transformers 4 writes `rope_theta` at the top level and the scaling as `rope_scaling`
(its type under `rope_type`, or `type` in older files); transformers 5 writes both as
`rope_parameters`. Both are read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np

from .config import TINY_LLAMA, DecoderConfig
from .rope import Llama3RopeScaling
from .weights import Weights, check_weights, init_weights, read_safetensors, save_safetensors

SUPPORTED_MODEL_TYPES = ("llama", "mistral")

_INDEX = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


def _read_json(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _required(hf: Mapping[str, Any], key: str) -> Any:
    if key not in hf:
        raise ValueError(f"config.json has no {key!r}")
    return hf[key]


def _rope(hf: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """`(rope_theta, scaling)` from transformers 5's `rope_parameters` or 4's keys."""
    params = hf.get("rope_parameters")
    if params is not None:
        source = "rope_parameters"
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    else:
        source = "rope_scaling"
        params = hf.get("rope_scaling") or {}
        theta = hf.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        # A scaling without its type, or transformers 5's per-layer-type form
        # ({"full_attention": {...}, ...}), must not pass as plain RoPE.
        unknown = sorted(params.keys() - {"rope_type", "type", "rope_theta"})
        if unknown:
            raise ValueError(f"{source} has keys plain RoPE does not use: {unknown}")
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(
            f"{source} has rope_type {rope_type!r}; mokv supports 'default' and 'llama3'"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        raise ValueError(f"{source} of rope_type 'llama3' lacks {', '.join(missing)}")
    return float(theta), Llama3RopeScaling(**{k: params[k] for k in keys})


def _refuse_unsupported(hf: Mapping[str, Any]) -> None:
    """Raises ValueError naming the first setting the decoder cannot honour."""
    model_type = hf.get("model_type", "llama")
    if model_type == "qwen2":
        raise ValueError(
            "model_type 'qwen2' has q/k/v biases, which mokv's fused QKV kernel cannot add"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            raise ValueError(f"config.json sets {key}=true; the decoder has no biases")
    activation = hf.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"hidden_act {activation!r} is not supported (the MLP is SwiGLU: 'silu')")
    window = hf.get("sliding_window")
    if window is not None and window < hf.get("max_position_embeddings", 0):
        raise ValueError(
            f"sliding_window={window} is shorter than max_position_embeddings; "
            "the decoder attends to the whole context"
        )


def config_from_hf(source: str | PathLike[str] | Mapping[str, Any]) -> DecoderConfig:
    """The DecoderConfig of a Hugging Face `config.json` (its path, its directory, or its dict).

    Missing optional keys take transformers' Llama defaults: `num_key_value_heads` =
    `num_attention_heads`, `head_dim` = `hidden_size // num_attention_heads`,
    `rms_norm_eps` 1e-6, `rope_theta` 10000. `max_seq_len` is `max_position_embeddings`
    (the RoPE table's length; `dataclasses.replace` it to save memory on short runs).
    Raises ValueError naming what the decoder cannot honour (see the module docstring).
    """
    if isinstance(source, Mapping):
        hf: Mapping[str, Any] = source
    else:
        path = Path(source)
        hf = _read_json(path / "config.json" if path.is_dir() else path)
    _refuse_unsupported(hf)
    rope_theta, rope_scaling = _rope(hf)
    hidden_size = _required(hf, "hidden_size")
    n_heads = _required(hf, "num_attention_heads")
    return DecoderConfig(
        vocab_size=_required(hf, "vocab_size"),
        hidden_size=hidden_size,
        num_layers=_required(hf, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hidden_size // n_heads,
        intermediate_size=_required(hf, "intermediate_size"),
        max_seq_len=_required(hf, "max_position_embeddings"),
        rope_theta=rope_theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_scaling=rope_scaling,
    )


def _read_shards(directory: Path) -> Weights:
    """Every tensor of the directory's one file, or of the shards its index lists."""
    if not (directory / _INDEX).exists():
        if not (directory / _SINGLE_FILE).exists():
            raise FileNotFoundError(f"{directory} has neither {_SINGLE_FILE} nor {_INDEX}")
        return read_safetensors(directory / _SINGLE_FILE)
    weight_map: dict[str, str] = _read_json(directory / _INDEX)["weight_map"]
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (directory / s).exists()]
    if missing:
        raise FileNotFoundError(f"{_INDEX} lists shards missing from {directory}: {missing}")
    weights: Weights = {}
    for shard in shards:
        tensors = read_safetensors(directory / shard)
        twice = sorted(tensors.keys() & weights.keys())
        if twice:
            raise ValueError(f"tensors {twice} appear in more than one shard (again in {shard!r})")
        weights |= tensors
    absent = sorted(name for name, shard in weight_map.items() if name not in weights)
    if absent:
        raise ValueError(f"{_INDEX} lists tensors that no shard holds: {absent}")
    return weights


def load_checkpoint(directory: str | PathLike[str]) -> tuple[DecoderConfig, Weights]:
    """`(config, weights)` of a Hugging Face checkpoint directory, checked against each other.

    With `tie_word_embeddings` the LM head is the embedding (a saved `lm_head.weight`
    must then equal it); without, the checkpoint must hold `lm_head.weight`. Raises
    ValueError naming a missing, misshapen or unused tensor (`check_weights`), or an
    unsupported setting (`config_from_hf`); FileNotFoundError naming missing files.
    """
    directory = Path(directory)
    hf = _read_json(directory / "config.json")
    config = config_from_hf(hf)
    weights = _read_shards(directory)
    if hf.get("tie_word_embeddings", False) and "model.embed_tokens.weight" in weights:
        embedding = weights["model.embed_tokens.weight"]
        saved_head = weights.get("lm_head.weight")
        if saved_head is not None and not np.array_equal(saved_head, embedding):
            raise ValueError(
                "config.json sets tie_word_embeddings=true but lm_head.weight differs from "
                "model.embed_tokens.weight"
            )
        weights["lm_head.weight"] = embedding
    check_weights(config, weights)
    return config, weights


def hf_config(config: DecoderConfig, dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` of a `LlamaForCausalLM` with `config`'s sizes (`dtype` weights,
    token 1 as BOS and 2 as EOS); `config_from_hf` reads it back to `config`."""
    hf: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if config.rope_scaling is not None:
        hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(config.rope_scaling)}
    return hf


def save_checkpoint(
    directory: str | PathLike[str],
    config: DecoderConfig,
    weights: Weights,
    dtype: str = "float32",
) -> Path:
    """Writes `config.json`, `model.safetensors` and a word-level tokenizer (token `i` is
    the word `t{i}`; `tokenizer.json`, `tokenizer_config.json`) into `directory`, made if
    missing; returns the directory. `dtype` "float32" (MAX's CPU and GPU pipelines) or
    "bfloat16" (its GPU pipelines' usual weights). ValueError naming a tensor that does
    not fit `config` (`check_weights`). The tokenizer needs the `tokenizers` package (the
    serve extra)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    check_weights(config, weights)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(config, dtype), indent=2))
    save_safetensors(out / _SINGLE_FILE, weights, None if dtype == "float32" else dtype)
    return save_word_tokenizer(out, config.vocab_size)


def save_word_tokenizer(directory: str | PathLike[str], vocab_size: int) -> Path:
    """Writes the word-level tokenizer of `save_checkpoint` (token `i` is the word `t{i}`,
    `t1` BOS, `t2` EOS, a chat template of plain words) for `vocab_size` tokens into
    `directory`, beside a checkpoint written by other means (a Hugging Face model's
    `save_pretrained`); returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out = Path(directory)
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Words joined by spaces; a tokenizer.json without a decoder makes the grammar
    # engine of MAX's server warn at every start.
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": "t1", "eos_token": "t2", "unk_token": "t0"}
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", **special, "chat_template": CHAT_TEMPLATE}
        )
    )
    return out


CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{{ part['text'] }} {% endfor %}{% endif %}"
    " {% endfor %}"
)
"""The checkpoint's chat template: every message's text (or its content parts' texts), in
order, joined by spaces, no roles or markers, so that a chat request of words `t{i}` is
the token ids `i` in order (chat requests to MAX's server need a template)."""


def tiny_llama_checkpoint(directory: str | PathLike[str]) -> Path:
    """`TINY_LLAMA` with `init_weights(seed=0)` saved in `directory`, unless a checkpoint
    of it is there already; returns the directory."""
    out = Path(directory)
    if (out / "config.json").exists() and config_from_hf(out) == TINY_LLAMA:
        return out
    return save_checkpoint(out, TINY_LLAMA, init_weights(TINY_LLAMA, seed=0))
