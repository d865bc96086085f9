"""The kernels on a real GPU, against the same numpy references and checks as on the CPU.

Skipped unless MAX sees an accelerator (`max.driver.accelerator_count() > 0`); users run
them with pixi on NVIDIA hardware. They passed on an NVIDIA H200 (the float32 QKV cases
with an earlier form of their kernel; docs/gpus.md, "Running on an NVIDIA GPU";
`benchmarks/gpu_machine.sh tests` runs them on a machine without network). That every op compiles for sm_90 and gfx942 is checked everywhere by
test_virtual_gpu.py.

The CPU tests read the kernels' writes straight from the numpy arrays their input
buffers alias. `OnGpu` keeps that contract: it copies the inputs to the GPU, runs, and
copies the cache (the first input) and the outputs back, so the CPU tests' runners and
checks are reused unchanged.
"""

from __future__ import annotations


import pytest
from max.driver import CPU, Accelerator, accelerator_count
from max.engine import InferenceSession
from max.dtype import DType
from max.graph import DeviceRef

from mokv.compiler_output import filter_collection_warnings
from mokv.ops import kernels_path

from .conftest import PARTS
from .graph_bundle import bundle_graph
from .test_fused_qkv import CASES, LAYOUTS, _check, _ids
from . import test_store_attention as cpu_tests  # a module: its tests are not collected twice
from .test_store_attention import (
    CONT_F32_MHA,
    PAGED_BF16_GQA1,
    PAGED_BF16_GQA4,
    PAGED_BF16_GQA8,
    PAGED_F32_GQA4,
    check,
    run_store_attention,
)

pytestmark = pytest.mark.skipif(
    accelerator_count() == 0, reason="needs a GPU (runs where MAX sees an accelerator)"
)


class OnGpu:
    """A model loaded for the GPU, executed on CPU buffers as the CPU tests do."""

    def __init__(self, model, gpu) -> None:
        self.model, self.gpu = model, gpu

    def execute(self, *inputs):
        devices = self.model.input_devices  # host-side tables (max_lengths) stay on the host
        on_gpu = [b if d.is_host else b.copy(self.gpu) for b, d in zip(inputs, devices)]
        # Copies are enqueued, not done: measured on the CPU device, a model that ran right
        # after `copy` read a not-yet-copied input in about 1 run of 6.
        self.gpu.synchronize()
        outputs = self.model.execute(*on_gpu)
        inputs[0].inplace_copy_from(on_gpu[0])  # the cache's blocks, written by the kernels
        outputs = [out.to(CPU()) for out in outputs]
        self.gpu.synchronize()
        return outputs


@pytest.fixture(scope="module")
def gpu_compiled():
    """`gpu_compiled(kind, cfg)`: like conftest's `compiled`, built for the GPU."""
    gpu = Accelerator()
    session = InferenceSession(devices=[CPU(), gpu])
    models: dict = {}

    def get(kind, cfg):
        if (kind, cfg) not in models:
            graph, _ = bundle_graph(kind, [PARTS[kind](cfg, DeviceRef.GPU())], [kernels_path()])
            with filter_collection_warnings():
                models[kind, cfg] = OnGpu(session.load(graph), gpu)
        return models[kind, cfg]

    return get


@pytest.mark.parametrize("cfg", [PAGED_F32_GQA4, PAGED_BF16_GQA8, CONT_F32_MHA], ids=str)
def test_store_then_attention_on_gpu(gpu_compiled, cfg):
    # prefill from empty | decode at 37 | a 9-token chunk after 70 (several pages)
    check(cfg, *run_store_attention(gpu_compiled, cfg, [0, 37, 70], [20, 1, 9]))


@pytest.mark.parametrize("cache_lengths,new_tokens", [([1500, 700], [1, 3]), ([600], [40])])
def test_split_keys_on_gpu(gpu_compiled, cache_lengths, new_tokens):
    # Long contexts: keys split across units, partial states merged (`merge_splits`).
    cpu_tests.test_paged_f32_gqa4(gpu_compiled, cache_lengths, new_tokens)


@pytest.mark.parametrize("cfg", [PAGED_BF16_GQA1, PAGED_BF16_GQA4, PAGED_BF16_GQA8], ids=["gqa1", "gqa4", "gqa8"])
def test_bf16_long_decode_on_gpu(gpu_compiled, cfg):
    cpu_tests.test_paged_bf16_long_decode(gpu_compiled, cfg)


@pytest.mark.parametrize("cfg", CASES, ids=_ids)
def test_fused_qkv_then_attention_on_gpu(gpu_compiled, cfg):
    _check(gpu_compiled, cfg, *LAYOUTS["packed-22"])
