"""The kernels on a real GPU, against the same numpy references and checks as on the CPU.

Skipped unless MAX sees an accelerator (`max.driver.accelerator_count() > 0`); users run
them with pixi on NVIDIA hardware. They passed on an NVIDIA H200 on 2026-11-26
(`benchmarks/gpu_machine.sh tests` runs them on a machine without network;
docs/gpus.md). That every op compiles for sm_90 and gfx950 is checked everywhere by
test_virtual_gpu.py.

The CPU tests read the kernels' writes straight from the numpy arrays their input
buffers alias. `OnGpu` keeps that contract: it copies the inputs to the GPU, runs, and
copies the cache (the first input) and the outputs back, so the CPU tests' runners and
checks are reused unchanged.
"""

from __future__ import annotations

import dataclasses

import pytest
from max.driver import CPU, Accelerator, accelerator_count
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef
from mokv.compiler_output import filter_collection_warnings
from mokv.ops import kernels_path

from . import test_store_attention as cpu_tests  # a module: its tests are not collected twice
from . import test_window_attention
from .conftest import PARTS, Config
from .graph_bundle import Bundle
from .test_fp8_dequantize import FP8_GPU_TOL, check_scaled_attention, scaled_attention_model
from .test_fused_qkv import CASES, LAYOUTS, _check, _ids
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


def on_gpu_pages(cfg: Config) -> Config:
    """`cfg` as a GPU runs it: MAX's attention kernel takes pages of a multiple of 128
    tokens (`flash_attention` refuses others there), so paged configurations use 128."""
    return dataclasses.replace(cfg, page_size=128) if cfg.strategy == "paged" else cfg


PAGED_F32_GQA4_GPU, PAGED_BF16_GQA1_GPU, PAGED_BF16_GQA4_GPU, PAGED_BF16_GQA8_GPU = map(
    on_gpu_pages, [PAGED_F32_GQA4, PAGED_BF16_GQA1, PAGED_BF16_GQA4, PAGED_BF16_GQA8]
)
QKV_CASES = [on_gpu_pages(cfg) for cfg in CASES]
GPU_F32_TOL = 5e-3
"""MAX's attention kernel runs float32 on TF32 tensor cores (Q, K, P and V rounded to 10
mantissa bits): on an H200 its outputs were 3.5e-4 to 2.8e-3 from the float64 reference
(2026-11-26), where mokv's CPU kernel is held to 2e-5. bfloat16 keeps the CPU's 2e-2."""


def gpu_tol(cfg: Config) -> float | None:
    return GPU_F32_TOL if cfg.dtype == DType.float32 else None
# MAX's sliding-window mask on pages of 128: a window that starts mid-page, one over pages.
WINDOW_F32_GQA4_GPU = dataclasses.replace(PAGED_F32_GQA4_GPU, window=37)
WINDOW_BF16_GQA8_GPU = dataclasses.replace(PAGED_BF16_GQA8_GPU, window=300)
GPU_CONFIGS = {
    "store_attention": [PAGED_F32_GQA4_GPU, PAGED_BF16_GQA8_GPU, CONT_F32_MHA, PAGED_BF16_GQA1_GPU,
                        PAGED_BF16_GQA4_GPU, WINDOW_F32_GQA4_GPU, WINDOW_BF16_GQA8_GPU],
    "qkv_attention": QKV_CASES,
}
"""Every configuration these tests run, per graph kind: one model per kind, as on the CPU."""


class OnGpu:
    """One part of a model loaded for the GPU, executed on CPU buffers as the CPU tests do."""

    def __init__(self, bundle: Bundle, index: int, gpu) -> None:
        self.bundle, self.index, self.gpu = bundle, index, gpu

    def execute(self, *inputs):
        devices = self.bundle.input_devices(self.index)  # host-side tables (max_lengths) stay
        on_gpu = [b if d.is_host else b.copy(self.gpu) for b, d in zip(inputs, devices)]
        # Copies are enqueued, not done: measured on the CPU device, a model that ran right
        # after `copy` read a not-yet-copied input in about 1 run of 6.
        self.gpu.synchronize()
        outputs = self.bundle.execute_part(self.index, on_gpu)
        inputs[0].inplace_copy_from(on_gpu[0])  # the cache's blocks, written by the kernels
        outputs = [out.to(CPU()) for out in outputs]
        self.gpu.synchronize()
        return outputs


@pytest.fixture(scope="module")
def gpu_compiled():
    """`gpu_compiled(kind, cfg)`: like conftest's `compiled`, built for the GPU (every
    configuration of GPU_CONFIGS[kind] in one model, on the first call for a kind)."""
    gpu = Accelerator()
    session = InferenceSession(devices=[CPU(), gpu])
    runners: dict = {}

    def get(kind, cfg):
        if (kind, cfg) not in runners:
            configs = GPU_CONFIGS[kind]
            with filter_collection_warnings():
                parts = [PARTS[kind](c, DeviceRef.GPU()) for c in configs]
                bundle = Bundle(session, f"{kind}_gpu", parts, custom_extensions=[kernels_path()])
            runners.update(((kind, c), OnGpu(bundle, i, gpu)) for i, c in enumerate(configs))
        return runners[kind, cfg]

    return get


@pytest.mark.parametrize("cfg", [PAGED_F32_GQA4_GPU, PAGED_BF16_GQA8_GPU, CONT_F32_MHA], ids=str)
def test_store_then_attention_on_gpu(gpu_compiled, cfg):
    # prefill from empty | decode at 37 | a 9-token chunk after 70
    check(cfg, *run_store_attention(gpu_compiled, cfg, [0, 37, 70], [20, 1, 9]), tol=gpu_tol(cfg))


@pytest.mark.parametrize("cache_lengths,new_tokens", [([1500, 700], [1, 3]), ([600], [40])])
def test_split_keys_on_gpu(gpu_compiled, cache_lengths, new_tokens):
    # Long contexts over many pages: MAX splits the keys across blocks and merges them.
    cfg = PAGED_F32_GQA4_GPU
    check(cfg, *run_store_attention(gpu_compiled, cfg, cache_lengths, new_tokens), tol=gpu_tol(cfg))


@pytest.mark.parametrize("cfg", [PAGED_BF16_GQA1_GPU, PAGED_BF16_GQA4_GPU, PAGED_BF16_GQA8_GPU],
                         ids=["gqa1", "gqa4", "gqa8"])
def test_bf16_long_decode_on_gpu(gpu_compiled, cfg):
    cpu_tests.test_paged_bf16_long_decode(gpu_compiled, cfg)


@pytest.mark.parametrize("cfg", QKV_CASES, ids=_ids)
def test_fused_qkv_then_attention_on_gpu(gpu_compiled, cfg):
    _check(gpu_compiled, cfg, *LAYOUTS["packed-22"], attn_tol=gpu_tol(cfg))


@pytest.mark.parametrize("cfg", [WINDOW_F32_GQA4_GPU, WINDOW_BF16_GQA8_GPU], ids=["f32-w37", "bf16-w300"])
@pytest.mark.parametrize("cache_lengths,new_tokens", test_window_attention.CASES)
def test_sliding_window_on_gpu(gpu_compiled, cfg, cache_lengths, new_tokens):
    """MAX's `sliding_window_causal` mask through mokv's view, as on the CPU
    (test_max_kernels.py: the keys before the windows hold large values, masked)."""
    out = run_store_attention(gpu_compiled, cfg, cache_lengths, new_tokens, seed=len(cache_lengths),
                              unread=40.0)
    check(cfg, *out, tol=gpu_tol(cfg))



def test_scaled_fp8_pages_on_gpu():
    """test_fp8_dequantize.py's checks of the GPU path of scaled FP8 pages, on a GPU:
    store_kv (the CPU's row quantizer), then attention through the bfloat16 scratch."""
    gpu = Accelerator()
    model = scaled_attention_model(InferenceSession(devices=[CPU(), gpu]), DeviceRef.GPU())
    check_scaled_attention(model, gpu, FP8_GPU_TOL)
