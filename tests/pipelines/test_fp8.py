"""FP8 pages through `mokv.pipelines` (issue 53): MAX 26.7's params with a quantization
config (scaled pages) or with an FP8 dtype alone (its Llama's `--kv-cache-format
float8_e4m3fn`, unscaled) load a mokv manager whose inputs are MAX's own manager's, leaf
by leaf in `max.tree` order; `mokv.max_kv_params` gives the params back."""

from __future__ import annotations

import pytest
from max import tree
from max.dtype import DType
from max.graph import DeviceRef
from max.nn.kv_cache import KVCacheQuantizationConfig
from mokv import KVCacheQuantization, max_kv_params
from mokv.pipelines import load_kv_manager as mokv_loader
from mokv.pipelines import mokv_params

from .conftest import loader_args, max_context, max_params

SCALED = dict(
    dtype=DType.float8_e4m3fn,
    head_dim=256,
    kvcache_quant_config=KVCacheQuantizationConfig(quantization_granularity=128),
)
UNSCALED = dict(dtype=DType.float8_e4m3fn, head_dim=256)
FORMATS = {"scaled": SCALED, "unscaled": UNSCALED}


def leaves(manager) -> list[list]:
    """Each device's input leaves, as (kind, dtype, shape), after a prompt and a decode."""
    ctx = max_context([1, 2, 3])
    manager.claim(ctx)
    manager.alloc(ctx)
    seen = [manager.runtime_inputs([[ctx]])]
    ctx.update(4)
    manager.step(ctx)
    manager.alloc(ctx)
    seen.append(manager.runtime_inputs([[ctx]]))
    manager.release(ctx)
    return [
        [(type(leaf).__name__, leaf.dtype, tuple(leaf.shape)) for leaf in tree.leaves(device)]
        for step in seen
        for device in step
    ]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_inputs_are_max_s_own_manager_s_leaf_by_leaf(session, fmt):
    from max.pipelines.kv_cache import load_kv_manager as max_loader

    args = loader_args(session, **FORMATS[fmt])
    args["available_cache_memory"] = 9 * args["params"].bytes_per_block
    theirs_manager, ours_manager = max_loader(**args), mokv_loader(**args)
    theirs, ours = leaves(theirs_manager), leaves(ours_manager)
    for manager in (theirs_manager, ours_manager):
        manager.shutdown()
    assert len(ours) == len(theirs) == 2
    scaled = fmt == "scaled"
    for mine, max_own in zip(ours, theirs):
        assert len(mine) == len(max_own) == (10 if scaled else 7)
        if scaled:
            # kv_scales: MAX's pool gives its scales leaf pages of their own (288 for the 9
            # value pages on this CPU); mokv's scales share the values' page ids.
            (_, dtype, shape), (_, max_dtype, max_shape) = mine[6], max_own[6]
            assert dtype == max_dtype == DType.float32
            assert shape[1:] == max_shape[1:] == (2, 2, 128, 2, 2)
            assert shape[0] == mine[0][2][0] == 9
            mine, max_own = mine[:6] + mine[7:], max_own[:6] + max_own[7:]
        assert mine == max_own


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_served_trace_reads_as_on_max_s_own_manager(session, fmt):
    """test_manager.py's trace (prefix hits, decode steps, a capture replay, releases),
    with FP8 pages: everything MAX's scheduler reads is MAX's own manager's, but for the
    pages in use of scaled pages: 3 pages of values and scales to mokv, 4 blocks to MAX's
    Jenga pool, which tiles the scales leaf on a page grid of its own."""
    from max.pipelines.kv_cache import load_kv_manager as max_loader

    from .test_manager import run_trace

    args = loader_args(session, **FORMATS[fmt])
    args["available_cache_memory"] = 9 * args["params"].bytes_per_block
    managers = max_loader(**args), mokv_loader(**args)
    (theirs, _), (ours, _) = (run_trace(m) for m in managers)
    buffers = managers[1].get_device_buffer(0)  # MAX's KVCacheBuffer: the scales beside
    assert (buffers.scales is not None) == (fmt == "scaled")
    for manager in managers:
        manager.shutdown()
    used = 8  # `run_trace`'s entry of `block_count().used` with both requests running
    assert ours[used] == 3 and theirs[used] == (4 if fmt == "scaled" else 3)
    assert ours[:used] + ours[used + 1 :] == theirs[:used] + theirs[used + 1 :]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_tree_of_groups_of_fp8_pages(session, fmt):
    """test_groups.py's trace (a sliding window and a full group, pages sliding off)
    with FP8 pages reads as on MAX's own manager, and each group's inputs are MAX's leaf
    by leaf in tree order: for scaled pages its three scale fields beside its values
    (mokv's scales leaf with the values' pages, MAX's with pages of its own)."""
    from max.nn.kv_cache import KVCacheInputsPerDevice, MultiKVCacheParams

    from .test_groups import loaders, trace

    def params_tree(fields: dict) -> MultiKVCacheParams:
        return MultiKVCacheParams.from_params({
            "sliding_attention": max_params(num_layers=3, window_size=200, **fields),
            "full_attention": max_params(num_layers=1, **fields),
        })

    def scales(manager) -> list:
        """Every leaf's kind, dtype and rank, and each group's scale fields."""
        ctx = max_context([1, 2, 3])
        manager.claim(ctx)
        manager.alloc(ctx)
        inputs = manager.runtime_inputs([[ctx]])
        manager.release(ctx)
        fields = [
            (d.kv_scales.dtype, d.kv_scales.shape[1:], d.scales_page_stride.to_numpy().tolist(),
             d.scales_lookup_table.shape)
            for d in tree.leaves(inputs, leaf=KVCacheInputsPerDevice)
            if d.kv_scales is not None
        ]
        kinds = [(type(leaf).__name__, leaf.dtype, len(leaf.shape)) for leaf in tree.leaves(inputs)]
        return [list(inputs), kinds, fields]

    theirs, ours = loaders(session, params_tree(FORMATS[fmt]), pages=400)
    assert trace(ours) == trace(theirs)
    mine, max_own = scales(ours), scales(theirs)
    assert mine == max_own
    assert len(mine[1]) == (20 if fmt == "scaled" else 14)
    if fmt == "scaled":
        assert mine[2] == [(DType.float32, (2, 3, 128, 2, 2), [-1], (1, 24)),
                           (DType.float32, (2, 1, 128, 2, 2), [-1], (1, 24))]
    for manager in (theirs, ours):
        manager.shutdown()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_max_params_become_mokv_s_format_and_back(fmt):
    theirs = max_params(**FORMATS[fmt])
    ours = mokv_params(theirs)
    assert ours.dtype == DType.float8_e4m3fn
    if fmt == "scaled":
        assert ours.quantization == KVCacheQuantization(DType.float32, 128)
        assert ours.page_format == "float8_e4m3fn:float32:128"
    else:
        assert ours.quantization is None and ours.page_format == "float8_e4m3fn"
    back = max_kv_params(ours, theirs.num_layers, [DeviceRef.CPU()])
    assert back.kvcache_quant_config == theirs.kvcache_quant_config
    assert back.bytes_per_block == theirs.bytes_per_block
    assert back.get_symbolic_inputs() == theirs.get_symbolic_inputs()


def test_the_gpu_script_builds_max_s_fp8_llama_config_on_the_cpu(tmp_path):
    """benchmarks/gpu/llama_fp8.py runs on a GPU only (MAX compiles no FP8 op for a CPU);
    here its config and checkpoint are built, as its `--check` does."""
    import importlib.util
    from pathlib import Path

    from max.driver import DeviceSpec

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "llama_fp8.py"
    spec = importlib.util.spec_from_file_location("llama_fp8", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    config = script.pipeline_config(script.tiny_checkpoint(tmp_path), DeviceSpec.cpu())
    assert config.models["main"].kv_cache.kv_cache_format == "float8_e4m3fn"
    assert (tmp_path / "model.safetensors").is_file()
    assert len(script.prompts()[0]) > script.PAGE_SIZE
