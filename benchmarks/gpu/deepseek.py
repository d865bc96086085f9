"""MAX 26.7's own DeepSeek-V2 pipeline (`DeepseekV2ForCausalLM`: MLA attention, bfloat16,
GPU only) generating on a mokv MLA cache and on MAX's own manager: the same tokens.

    python benchmarks/gpu/deepseek.py [--json FILE]     on a machine with a GPU
    python benchmarks/gpu/deepseek.py --check           anywhere: writes the checkpoint,
                                                       imports MAX's pipeline, runs nothing

The model is tiny and random: the MLA decoder's weights (graphs/mla_decoder.py) at
DeepSeek-V2-Lite's attention shapes (16 heads of 128 + 64, values of 128, a latent of
512 and a RoPE key of 64: what MAX's MLA kernels take), hidden size 256, two dense
layers, written as an HF checkpoint in bfloat16 (graphs/mla_hf.py) with the fields MAX's
DeepseekV2Config reads (a YaRN `rope_scaling` of factor 1). MAX's pipeline is built
twice from one `PipelineConfig` as for the other cache kinds (benchmarks/gpu/pipelines.py's
`compare`): with its own manager, then twice with mokv's through the seam `mokv serve`
uses; prompts share a prefix of 300 tokens, which mokv's second run finds in its prefix
cache. Prints TOKENS_EQUAL or TOKENS_DIFFER and exits 0 only on the first.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from mokv_graphs.checkpoint import save_word_tokenizer
from mokv_graphs.mla_decoder import MLADecoderConfig, init_mla_weights
from mokv_graphs.mla_hf import hf_config, hf_state_dict
from mokv_graphs.weights import save_safetensors

CONFIG = MLADecoderConfig(
    vocab_size=256, hidden_size=256, n_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, kv_lora_rank=512, intermediate_size=512, num_layers=2, max_seq_len=1024,
)
MAX_FIELDS = {
    # What MAX's DeepseekV2Config reads besides DeepSeek-V2's HF fields (MoE routing,
    # which dense layers leave unused) and the YaRN RoPE its model builds.
    "aux_loss_alpha": 0.001, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
    "topk_method": "greedy", "scoring_func": "softmax", "seq_aux": True,
    "norm_topk_prob": False, "routed_scaling_factor": 1.0, "pretraining_tp": 1,
    "initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0,
    "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 1.0,
                     "original_max_position_embeddings": CONFIG.max_seq_len,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}


def write_checkpoint(path: Path) -> Path:
    """The tiny model's bfloat16 checkpoint and word tokenizer in `path`; returns it."""
    config = hf_config(CONFIG) | MAX_FIELDS
    del config["rope_parameters"]  # transformers derives it from rope_scaling
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_safetensors(path / "model.safetensors",
                     hf_state_dict(CONFIG, init_mla_weights(CONFIG, seed=0)), "bfloat16")
    return save_word_tokenizer(path, CONFIG.vocab_size)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write and import only")
    parser.add_argument("--json", type=Path, help="where to write the result")
    args = parser.parse_args()
    from max.pipelines.architectures.deepseekV2.arch import deepseekV2_arch

    # benchmarks/gpu/pipelines.py, this script's sibling (found through sys.path[0])
    from pipelines import compare  # type: ignore[import-not-found]

    with tempfile.TemporaryDirectory(prefix="mokv-deepseekV2-") as tmp:
        path = write_checkpoint(Path(tmp))
        if args.check:
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(path)
            print("CHECKED", deepseekV2_arch.name, hf.model_type, hf.kv_lora_rank)
            return 0
        result = {"arch": "deepseekV2", **compare("deepseekV2", path)}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print("TOKENS_EQUAL" if result["tokens_equal"] else "TOKENS_DIFFER")
    return 0 if result["tokens_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
