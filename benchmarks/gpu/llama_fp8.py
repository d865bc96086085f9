"""MAX 26.7's Llama pipeline with an FP8 KV cache (`kv_cache_format="float8_e4m3fn"`) on a
GPU: the same tokens on mokv's manager as on MAX's own (issue 53).

MAX's Llama builds unscaled FP8 pages for that format (docs/quantized.md): its kernels
cast each key and value to float8_e4m3fn as they store it and back as they read it.
mokv's manager holds those pages (`KVCacheParams(dtype=float8_e4m3fn)`, no scales) and
hands MAX the same inputs as its own manager, so the generated tokens must be equal,
token for token. The model is a tiny Llama with random bfloat16 weights (a local
checkpoint, `mokv_graphs.save_checkpoint`); prompts share a page-long prefix, and a
second run on mokv's cache finds it in mokv's prefix cache (the FP8 pages reused).

MAX compiles no FP8 op for a CPU, so this runs on a GPU only. With MAX 26.7 it is
expected to stop in MAX's own pipeline, on MAX's manager, before any mokv code: its
`AttentionWithRope` hands bfloat16 queries to `flash_attention_ragged`, which takes
queries of the cache's dtype only ("expected input to be dtype: DType.float8_e4m3fn";
tests/ops/test_fp8_refusals.py), and its attention kernel reads FP8 pages only on
sm_100-class and AMD GPUs (docs/quantized.md). The error lands in the JSON.

    python benchmarks/gpu/llama_fp8.py [--json PATH]    # exit 0: identical tokens

`--check` (any machine) builds the pipeline config and imports what the run needs,
without a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PAGE_SIZE = 128  # MAX 26.7 pipelines take pages of 128 tokens or multiples of 128
NEW_TOKENS = 16


def pipeline_config(checkpoint: Path, device_spec):
    """MAX's config of the tiny Llama on `device_spec` with an FP8 KV cache."""
    from max.pipelines import PipelineConfig
    from max.pipelines.kv_cache.config import KVCacheConfig
    from max.pipelines.lib.config.model_config import MAXModelConfig
    from max.pipelines.lib.pipeline_runtime_config import PipelineRuntimeConfig

    return PipelineConfig(
        models={
            "main": MAXModelConfig(
                model_path=str(checkpoint),
                weight_path=[checkpoint / "model.safetensors"],
                device_specs=[device_spec],
                quantization_encoding="bfloat16",
                max_length=1024,
                kv_cache=KVCacheConfig(
                    kv_cache_page_size=PAGE_SIZE,
                    enable_prefix_caching=True,
                    kv_cache_format="float8_e4m3fn",
                ),
            )
        },
        runtime=PipelineRuntimeConfig(max_batch_size=2),
    )


def tiny_checkpoint(directory: Path) -> Path:
    """`TINY_LLAMA` with heads of 128 (as MAX's GPU attention kernels take them), in
    bfloat16."""
    import mokv_graphs as mg

    config = dataclasses.replace(
        mg.TINY_LLAMA, hidden_size=256, n_heads=2, n_kv_heads=1, head_dim=128
    )
    return mg.save_checkpoint(directory, config, mg.init_weights(config, seed=0), "bfloat16")


def prompts() -> list[list[int]]:
    system = [int(t) for t in np.random.default_rng(1).integers(3, 256, 140)]  # > 1 page
    return [system + [60, 61, 62], system + [70, 71]]


def run(out: dict, directory: Path) -> bool:
    """Generates with MAX's manager, then twice with mokv's; True if every run gives
    MAX's tokens."""
    from max.driver import DeviceSpec
    from max.dtype import DType
    from max.pipelines import PIPELINE_REGISTRY
    from max.pipelines.lib.generate import generate
    from mokv.pipelines import KVCacheManager, MokvOptions, seams
    from mokv.pipelines.serve import MokvLoader

    config = pipeline_config(tiny_checkpoint(directory), DeviceSpec.accelerator())

    def generated(pipeline) -> list[list[int]]:
        t0 = time.perf_counter()
        seqs = generate(pipeline, prompts(), max_new_tokens=NEW_TOKENS, ignore_eos=True).sequences
        out.setdefault("seconds", []).append(round(time.perf_counter() - t0, 3))
        return [list(map(int, s)) for s in seqs]

    _, theirs = PIPELINE_REGISTRY.retrieve(config)
    expected = generated(theirs)
    max_params = getattr(theirs.kv_manager, "params", None)  # what MAX's Llama built
    out["max_kv_dtype"] = str(getattr(max_params, "dtype", None))
    seams.install_kv_manager_loader(MokvLoader(MokvOptions()))
    _, ours = PIPELINE_REGISTRY.retrieve(config)
    manager = ours.kv_manager
    assert isinstance(manager, KVCacheManager), type(manager)
    params = manager.manager.params
    out["mokv_params"] = {"dtype": str(params.dtype), "page_format": params.page_format,
                          "quantization": repr(params.quantization)}
    assert params.dtype == DType.float8_e4m3fn
    first, second = generated(ours), generated(ours)
    out["cache_tokens_second_run"] = manager.manager.metrics.cache_tokens
    out["tokens"] = {"max": expected, "mokv": first, "mokv_prefix_cached": second}
    out["identical"] = first == expected and second == expected
    return out["identical"]


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: mokv_graphs
    out: dict = {}
    if "--check" in sys.argv:
        from max.driver import DeviceSpec

        with tempfile.TemporaryDirectory() as d:
            config = pipeline_config(tiny_checkpoint(Path(d)), DeviceSpec.cpu())
        out["kv_cache_format"] = config.models["main"].kv_cache.kv_cache_format
        print(json.dumps(out))
        return 0
    from max.driver import accelerator_count

    if accelerator_count() == 0:
        print("no accelerator: MAX runs no FP8 op on a CPU", file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory() as d:
            ok = run(out, Path(d))
    except Exception as e:  # noqa: BLE001 - reported in the JSON with what ran before
        out["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        ok = False
    text = json.dumps(out, indent=1)
    print(text)
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
