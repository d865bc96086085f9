"""MAX's own pipelines of the cache kinds mokv holds, on mokv's manager against MAX's own
manager, on an NVIDIA GPU (issue 59, item 3; `benchmarks/gpu_machine.sh pipelines`).

Per architecture, a tiny random-weight bfloat16 checkpoint is written with Hugging Face
transformers (the GPU image holds torch; MAX 26.7 runs these architectures in bfloat16
only, so on GPUs only) beside `mokv_graphs.save_word_tokenizer`'s tokenizer. MAX's
pipeline then generates greedy tokens for prompts that share a prefix longer than the
sliding window, first with MAX's own KV manager, then with mokv's (built by MAX's
pipeline through `mokv.pipelines`, the seam `mokv serve` uses) twice: the tokens must be
identical each time, and mokv's second run must find the shared prefix in its cache
(for Qwen3.5, through a recurrent-state checkpoint: `prompts_of`; MAX 26.7's Qwen3.5
does not run on the CPU, so this is its only end-to-end check, not yet run).

    python benchmarks/gpu/pipelines.py [ARCH ...] [--json PATH] [--limit SECONDS]

ARCH is a key of `ARCHITECTURES` (default: all). Each runs in its own process, all at
once (a failure or a hang in one leaves the others' results); `--one ARCH` is that
process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

PAGE_SIZE = 128  # MAX 26.7 pipelines take pages of 128 tokens or multiples of 128
WINDOW = 128  # the sliding window: the shared prefix (300 tokens) outlasts it
NEW_TOKENS = 16
COMMON = {
    "vocab_size": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    # Gemma 3 (text): 5 sliding-window layers to 1 global one.
    "gemma3": (
        "Gemma3TextConfig",
        {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
         "sliding_window": WINDOW, "sliding_window_pattern": 6},
    ),
    # GPT-OSS: alternating sliding and full layers, attention sinks, a mixture of experts.
    "gpt_oss": (
        "GptOssConfig",
        {"hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
         "layer_types": ["sliding_attention", "full_attention"]},
    ),
    # Olmo 3: 3 sliding-window layers to 1 full one. YaRN RoPE as Olmo 3's long-context
    # checkpoints have it: MAX 26.7 reads transformers 5's `rope_parameters` of a plain
    # RoPE as a scaling of type "default" and refuses it.
    "olmo3": (
        "Olmo3Config",
        {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": WINDOW,
         "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                             "original_max_position_embeddings": 512}},
    ),
    # Qwen3.5 (text): a Gated DeltaNet layer beside a full-attention one; mokv's recurrent
    # state (docs/recurrent.md). MAX's tokenizer wants its media token ids in the config
    # and `<think>` tokens in the vocabulary (`STATE_ARCHITECTURES`).
    "qwen3_5": (
        "Qwen3_5TextConfig",
        {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 128, "linear_key_head_dim": 128,
         "linear_value_head_dim": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
         "image_token_id": 252, "video_token_id": 253, "vision_start_token_id": 254,
         "vision_end_token_id": 255},
    ),
}
STATE_ARCHITECTURES = {"qwen3_5": ("<think>", "</think>")}
"""Architectures with recurrent state, and the reasoning tokens their tokenizers want
(the vocabulary's words `t250` and `t251` become them)."""


def write_checkpoint(arch: str, directory: Path) -> Path:
    """`arch`'s tiny model with transformers' random initialization (seeded), saved as
    bfloat16 safetensors with the word tokenizer; returns the directory."""
    import mokv_graphs as mg
    import torch
    import transformers

    config_class, sizes = ARCHITECTURES[arch]
    config = getattr(transformers, config_class)(**COMMON, **sizes)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    mg.save_word_tokenizer(directory, COMMON["vocab_size"])
    if arch in STATE_ARCHITECTURES:
        tokenizer = json.loads((directory / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        for word, token in zip(STATE_ARCHITECTURES[arch], (250, 251)):
            del vocab[f"t{token}"]
            vocab[word] = token
        (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return directory


def prompts_of(arch: str, shared: list[int]) -> list[list[int]]:
    """Two prompts sharing a prefix. A recurrent state is checkpointed only where a
    forward ends on a page boundary, and `generate` runs a prompt in one forward: there
    the first prompt is two pages exactly, and the second extends it."""
    if arch in STATE_ARCHITECTURES:
        return [shared[: 2 * PAGE_SIZE], shared[: 2 * PAGE_SIZE] + [70, 71]]
    return [shared + [60, 61, 62], shared + [70, 71]]


def compare(arch: str, directory: Path) -> dict[str, Any]:
    """Generates with MAX's manager, then twice with mokv's; what matched and what mokv's
    prefix cache served."""
    import numpy as np
    from max.driver import DeviceSpec
    from max.pipelines import PIPELINE_REGISTRY, PipelineConfig
    from max.pipelines.kv_cache.config import KVCacheConfig
    from max.pipelines.lib.config.model_config import MAXModelConfig
    from max.pipelines.lib.generate import generate
    from max.pipelines.lib.pipeline_runtime_config import PipelineRuntimeConfig
    from mokv.pipelines import KVCacheManager, MokvOptions, seams
    from mokv.pipelines.serve import MokvLoader

    pipeline_config = PipelineConfig(
        models={
            "main": MAXModelConfig(
                model_path=str(directory),
                weight_path=sorted(directory.glob("*.safetensors")),
                device_specs=[DeviceSpec.accelerator()],
                quantization_encoding="bfloat16",
                max_length=1024,
                kv_cache=KVCacheConfig(kv_cache_page_size=PAGE_SIZE, enable_prefix_caching=True),
            )
        },
        runtime=PipelineRuntimeConfig(max_batch_size=2),
    )
    shared = [int(t) for t in np.random.default_rng(1).integers(3, 256, 300)]
    prompts = prompts_of(arch, shared)

    def run(pipeline: Any) -> list[list[int]]:
        return generate(pipeline, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True).sequences

    started = time.perf_counter()
    _, theirs = PIPELINE_REGISTRY.retrieve(pipeline_config)
    expected = run(theirs)
    del theirs
    seams.install_kv_manager_loader(MokvLoader(MokvOptions()))
    _, ours = PIPELINE_REGISTRY.retrieve(pipeline_config)
    manager = ours.kv_manager
    if not isinstance(manager, KVCacheManager):
        raise TypeError(f"MAX's pipeline built {type(manager).__name__}, not mokv's manager")
    first = run(ours)
    second = run(ours)
    metrics = manager.manager.metrics
    return {
        "tokens_equal": first == expected and second == expected,
        "max": expected,
        "mokv": [first, second],
        "mokv_input_tokens": metrics.input_tokens,
        "mokv_cache_tokens": metrics.cache_tokens,
        "seconds": round(time.perf_counter() - started, 1),
    }


def one(arch: str) -> dict[str, Any]:
    """The checkpoint and the comparison of `arch`, its error as text if either fails."""
    try:
        with tempfile.TemporaryDirectory(prefix=f"mokv-{arch}-") as tmp:
            return {"arch": arch, **compare(arch, write_checkpoint(arch, Path(tmp)))}
    except Exception:  # reported, not raised: the other architectures' results stand
        return {"arch": arch, "error": traceback.format_exc()[-3000:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("archs", nargs="*", metavar="ARCH")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--limit", type=float, default=540, help="seconds for them all")
    parser.add_argument("--one", choices=list(ARCHITECTURES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    unknown = sorted(set(args.archs) - set(ARCHITECTURES))
    if unknown:
        parser.error(f"unknown architectures {unknown}; known: {list(ARCHITECTURES)}")
    archs = args.archs or list(ARCHITECTURES)
    deadline = time.monotonic() + args.limit
    procs = {
        arch: subprocess.Popen([sys.executable, __file__, "--one", arch],
                               stdout=subprocess.PIPE, text=True)
        for arch in archs
    }
    results = []
    for arch, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = out.strip().splitlines()
            results.append(json.loads(lines[-1]) if lines else
                           {"arch": arch, "error": f"exit {proc.returncode}, no result"})
        except subprocess.TimeoutExpired:
            proc.kill()
            results.append({"arch": arch, "error": f"over {args.limit} s"})
    for r in results:
        verdict = r.get("error", "").splitlines()[-1:] or [
            f"tokens equal: {r['tokens_equal']}; mokv served {r['mokv_cache_tokens']} of "
            f"{r['mokv_cache_tokens'] + r['mokv_input_tokens']} prompt tokens from cache "
            f"({r['seconds']} s)"
        ]
        print(f"{r['arch']}: {verdict[0]}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
