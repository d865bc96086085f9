"""MAX 26.7's own Llama pipeline (`LlamaForCausalLM` through MAX's `Llama3Model` and
`TextGenerationPipeline`) on the CPU, generating with a mokv manager in place of MAX's
own (`mokv.managers.max_pipeline`): the same tokens as with MAX's manager, with prompts
that share a prefix and a second run that finds it in mokv's prefix cache.

The model is a tiny Llama with random weights written as a local checkpoint
(config.json, model.safetensors, a word-level tokenizer). Needs MAX's pipeline
dependencies (the `max-pipeline` extra) and compiles the model once (minutes on the
2-core box): marker `max_pipeline`, run by `make test-max-pipeline`, not `make test`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.max_pipeline

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PAGE_SIZE = 128  # MAX 26.7 pipelines take pages of 128 tokens or multiples of 128


def write_checkpoint(out: Path, seed: int = 0) -> Path:
    """A random Llama in Hugging Face's layout; returns the weights file."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    c = CONFIG
    (out / "config.json").write_text(json.dumps(c))
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    hidden, head_dim, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    ones = np.ones(hidden, np.float32)
    weights = {"model.embed_tokens.weight": w(c["vocab_size"], hidden), "model.norm.weight": ones,
               "lm_head.weight": w(c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": w(c["num_attention_heads"] * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(c["num_key_value_heads"] * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(c["num_key_value_heads"] * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, c["num_attention_heads"] * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": ones, p + "post_attention_layernorm.weight": ones,
        }
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(c["vocab_size"])},
                                           unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1", "eos_token": "t2",
        "unk_token": "t0"}))
    return out / "model.safetensors"


def test_a_max_llama_pipeline_generates_the_same_tokens_on_a_mokv_manager(tmp_path):
    from max.driver import CPU, DeviceSpec
    from max.engine import InferenceSession
    from max.pipelines import PIPELINE_REGISTRY, PipelineConfig
    from max.pipelines.kv_cache.config import KVCacheConfig
    from max.pipelines.lib.config.model_config import MAXModelConfig
    from max.pipelines.lib.generate import generate
    from max.pipelines.lib.pipeline_runtime_config import PipelineRuntimeConfig
    from mokv.managers.max_pipeline import MaxPipelineKVCacheManager

    weights = write_checkpoint(tmp_path)
    config = PipelineConfig(
        models={"main": MAXModelConfig(
            model_path=str(tmp_path), weight_path=[weights], device_specs=[DeviceSpec.cpu()],
            quantization_encoding="float32", max_length=512,
            kv_cache=KVCacheConfig(kv_cache_page_size=PAGE_SIZE))},
        runtime=PipelineRuntimeConfig(max_batch_size=2))
    _, pipeline = PIPELINE_REGISTRY.retrieve(config)
    system = [int(t) for t in np.random.default_rng(1).integers(3, 256, 140)]  # > 1 page
    prompts = [system + [60, 61, 62], system + [70, 71]]

    def run() -> list[list[int]]:
        return generate(pipeline, prompts, max_new_tokens=8, ignore_eos=True).sequences

    theirs = run()  # MAX's own manager
    assert [len(s) for s in theirs] == [len(p) + 8 for p in prompts]
    mokv_manager = MaxPipelineKVCacheManager.for_pipeline(pipeline, InferenceSession(devices=[CPU()]))
    pipeline._kv_manager = mokv_manager
    ours = run()
    assert ours == theirs
    prompt_tokens = sum(map(len, prompts))
    metrics = mokv_manager.manager.metrics  # mokv held every step: all prompt tokens computed
    assert (metrics.input_tokens, metrics.cache_tokens) == (prompt_tokens, 0)
    again = run()  # every prompt's first page is found in mokv's prefix cache now
    assert again == theirs
    metrics = mokv_manager.manager.metrics
    assert metrics.cache_tokens == 2 * PAGE_SIZE
    assert metrics.input_tokens == 2 * prompt_tokens - 2 * PAGE_SIZE
    assert mokv_manager.manager.num_free_blocks == mokv_manager.manager.total_num_pages
