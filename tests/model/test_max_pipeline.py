"""MAX 26.7's own Llama pipeline (`LlamaForCausalLM` through MAX's `Llama3Model` and
`TextGenerationPipeline`) on the CPU, generating with a mokv cache in place of MAX's
own: built by MAX's pipeline itself through `mokv.pipelines.load_kv_manager` (the seam
`mokv serve` uses), the same tokens as with MAX's manager, with prompts that share a
prefix and a second run that finds it in mokv's prefix cache.

The model is a tiny Llama with random weights written as a local checkpoint
(`mokv_graphs.tiny_llama_checkpoint`). It compiles the model once (minutes on the 2-core box;
`tests/pipelines/test_serve.py` serves the same model in `make test`): marker
`max_pipeline`, run by `make test-max-pipeline`, not `make test`.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.max_pipeline

PAGE_SIZE = 128  # MAX 26.7 pipelines take pages of 128 tokens or multiples of 128


def test_a_max_llama_pipeline_generates_the_same_tokens_on_a_mokv_cache(tmp_path):
    import mokv_graphs as mg
    from max.driver import DeviceSpec
    from max.pipelines import PIPELINE_REGISTRY, PipelineConfig
    from max.pipelines.kv_cache.config import KVCacheConfig
    from max.pipelines.lib.config.model_config import MAXModelConfig
    from max.pipelines.lib.generate import generate
    from max.pipelines.lib.pipeline_runtime_config import PipelineRuntimeConfig
    from mokv.pipelines import KVCacheManager, MokvOptions, seams
    from mokv.pipelines.serve import MokvLoader

    config = mg.DecoderConfig(
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_seq_len=512,
    )
    mg.save_checkpoint(tmp_path, config, mg.init_weights(config, seed=0))
    pipeline_config = PipelineConfig(
        models={
            "main": MAXModelConfig(
                model_path=str(tmp_path),
                weight_path=[tmp_path / "model.safetensors"],
                device_specs=[DeviceSpec.cpu()],
                quantization_encoding="float32",
                max_length=1024,
                kv_cache=KVCacheConfig(kv_cache_page_size=PAGE_SIZE, enable_prefix_caching=True),
            )
        },
        runtime=PipelineRuntimeConfig(max_batch_size=2),
    )
    system = [int(t) for t in np.random.default_rng(1).integers(3, 256, 140)]  # > 1 page
    prompts = [system + [60, 61, 62], system + [70, 71]]

    def run(pipeline) -> list[list[int]]:
        return generate(pipeline, prompts, max_new_tokens=8, ignore_eos=True).sequences

    _, theirs = PIPELINE_REGISTRY.retrieve(pipeline_config)  # MAX's own manager
    expected = run(theirs)
    assert [len(s) for s in expected] == [len(p) + 8 for p in prompts]
    seams.install_kv_manager_loader(MokvLoader(MokvOptions()))
    _, ours = PIPELINE_REGISTRY.retrieve(pipeline_config)
    manager = ours.kv_manager
    assert isinstance(manager, KVCacheManager)
    assert run(ours) == expected
    prompt_tokens = sum(map(len, prompts))
    metrics = manager.manager.metrics  # one batch: both prompts computed in full
    assert (metrics.input_tokens, metrics.cache_tokens) == (prompt_tokens, 0)
    assert run(ours) == expected  # every prompt's first page is cached now
    metrics = manager.manager.metrics
    assert (metrics.input_tokens, metrics.cache_tokens) == (
        2 * prompt_tokens - 2 * PAGE_SIZE,
        2 * PAGE_SIZE,
    )
    assert manager.block_count().free == manager.block_count().total
