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

import numpy as np
import pytest
from max.driver import (
    CPU,
    Accelerator,
    Buffer,
    accelerator_api,
    accelerator_architecture_name,
    accelerator_count,
)
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, ops
from mokv import KVCacheParams
from mokv.compiler_output import filter_collection_warnings
from mokv.layouts import PAGED, FetchPagedKVCacheCollection
from mokv.ops import flash_attention, kernels_path, store_kv
from mokv.ops._checks import NATIVE_FP8_CUDA_ARCHS

from ..fp8_reference import decode_e4m3fn, round_e4m3fn
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


# MAX's unscaled FP8 pages (docs/quantized.md): mokv's GPU store casts each value to
# e4m3fn, saturated at +-448; attention runs MAX's native FP8 path, the queries cast to
# e4m3fn and a bfloat16 output. Two sequences (a 200-token prefill over two pages, a
# 70-token one), a lookup table padded by 16 columns as MAX's GPU kernels read past a row.
FP8_H, FP8_NQ, FP8_D, FP8_PAGE, FP8_PAGES = 2, 8, 128, 128, 6
FP8_PARAMS = KVCacheParams(
    dtype=DType.float8_e4m3fn, n_kv_heads=FP8_H, head_dim=FP8_D, page_size=FP8_PAGE
)
FP8_TABLE = np.array([[3, 0] + [1] * 16, [5] + [1] * 17], np.uint32)
FP8_NEW = [200, 70]
FP8_SPECIALS = [447.0, 464.0, 465.0, 500.0, 1e6, np.inf, np.nan, 2.0**-9, 2.0**-10 * 3]
"""Written into layer 1: the cast's boundaries, past 448 (saturated), NaN (kept), subnormals."""


def _fp8_graph() -> Graph:
    gpu = DeviceRef.GPU()
    with Graph(
        "unscaled_fp8_gpu",
        input_types=[
            *PAGED.input_symbols(FP8_PARAMS, 2, 256, gpu),
            TensorType(
                DType.float32, ["tokens", FP8_H, FP8_D], device=gpu
            ),  # k (and layer 1's values)
            TensorType(DType.float32, ["tokens", FP8_H, FP8_D], device=gpu),  # v
            TensorType(DType.float32, ["tokens", FP8_NQ, FP8_D], device=gpu),  # q, made bfloat16
            TensorType(DType.float32, ["tokens", FP8_H, FP8_D], device=gpu),  # layer 1's values
            TensorType(DType.uint32, ["offsets"], device=gpu),
        ],
    ) as g:
        *cache, k, v, q, specials, offsets = g.inputs
        kv = FetchPagedKVCacheCollection(FP8_PARAMS, 2)(*cache)
        store_kv(kv, k, v, offsets, 0)
        store_kv(kv, specials, specials, offsets, 1)
        scale = 1 / np.sqrt(FP8_D)
        q = ops.cast(q, DType.bfloat16)
        g.output(
            ops.cast(flash_attention(kv, q, offsets, 0, scale), DType.float32),
            flash_attention(kv, ops.cast(q, DType.float32), offsets, 0, scale),
        )
    return g


def _causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """float64 causal GQA attention of one sequence's new tokens (an empty cache)."""
    n = q.shape[0]
    kh = np.repeat(k, FP8_NQ // FP8_H, axis=1)  # [n, n_q, D]
    vh = np.repeat(v, FP8_NQ // FP8_H, axis=1)
    s = np.einsum("qhd,khd->hqk", q, kh) / np.sqrt(FP8_D)
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), vh)


def test_unscaled_fp8_pages_on_gpu():
    """The pages hold exactly the float64 reference's e4m3fn cast of K, V and the
    specials; attention is within 2**-4 (e4m3fn's relative step: MAX's FP8 path also
    rounds the softmax weights it multiplies V by) of float64 attention over the cast
    queries, keys and values, in RMS relative to the outputs, and each element within
    max|v| / 16; a float32 q gives the bfloat16 output exactly, cast. Not yet run on a
    GPU (2026-11-28); MAX reads FP8 pages on sm_100-class and AMD GPUs only."""
    if accelerator_api() == "cuda" and not accelerator_architecture_name().startswith(NATIVE_FP8_CUDA_ARCHS):
        pytest.skip(f"MAX 26.7 reads no FP8 pages on {accelerator_architecture_name()} (sm_100+ or AMD)")
    gpu = Accelerator()
    session = InferenceSession(devices=[CPU(), gpu])
    with filter_collection_warnings():
        model = session.load(_fp8_graph())
    rng = np.random.default_rng(53)
    total = sum(FP8_NEW)
    k, v = rng.standard_normal((2, total, FP8_H, FP8_D)).astype(np.float32)
    q = rng.standard_normal((total, FP8_NQ, FP8_D)).astype(np.float32)
    specials = rng.standard_normal((total, FP8_H, FP8_D)).astype(np.float32)
    spots = rng.choice(specials.size, 4 * len(FP8_SPECIALS), replace=False)
    specials.reshape(-1)[spots] = np.repeat(FP8_SPECIALS, 4) * np.tile(
        [1, -1, 1, -1], len(FP8_SPECIALS)
    )
    bits = np.zeros((FP8_PAGES, 2, 2, FP8_PAGE, FP8_H, FP8_D), np.uint8)
    offsets = np.array([0, FP8_NEW[0], total], np.uint32)
    host = [
        Buffer.from_numpy(bits).view(DType.float8_e4m3fn),
        Buffer.from_numpy(np.zeros(2, np.uint32)),
        Buffer.from_numpy(FP8_TABLE),
        Buffer.from_numpy(np.array([[200, 200]], np.uint32)),
        *(Buffer.from_numpy(a) for a in (k, v, q, specials, offsets)),
    ]
    inputs = [b if i == 3 else b.copy(gpu) for i, b in enumerate(host)]  # max_lengths: host
    gpu.synchronize()
    out_bf16, out_f32 = (out.to(CPU()).to_numpy() for out in model.execute(*inputs))
    pages = inputs[0].to(CPU()).view(DType.uint8).to_numpy()
    gpu.synchronize()
    np.testing.assert_array_equal(out_f32, out_bf16)  # MAX's bfloat16, cast by the op

    q_bf16 = (q.view(np.uint32) + 0x7FFF + ((q.view(np.uint32) >> 16) & 1)) >> 16 << 16
    q_bf16 = q_bf16.astype(np.uint32).view(np.float32)
    for b, (page_ids, start, n) in enumerate([([3, 0], 0, 200), ([5], 200, 70)]):
        rows = slice(start, start + n)
        stored = np.concatenate([pages[p] for p in page_ids], axis=2)[:, :, :n]  # [2, 2, n, H, D]
        for layer, (ks, vs) in enumerate([(k, v), (specials, specials)]):
            np.testing.assert_array_equal(decode_e4m3fn(stored[0, layer]), round_e4m3fn(ks[rows]))
            np.testing.assert_array_equal(decode_e4m3fn(stored[1, layer]), round_e4m3fn(vs[rows]))
        vq = round_e4m3fn(v[rows])
        ref = _causal_attention(round_e4m3fn(q_bf16[rows]), round_e4m3fn(k[rows]), vq)
        err = out_f32[rows] - ref
        assert np.sqrt((err**2).mean() / (ref**2).mean()) < 2.0**-4, b
        assert np.abs(err).max() < np.abs(vq).max() / 16, b

def test_scaled_fp8_pages_on_gpu():
    """test_fp8_dequantize.py's checks of the GPU path of scaled FP8 pages, on a GPU:
    store_kv (the CPU's row quantizer), then attention through the bfloat16 scratch."""
    gpu = Accelerator()
    model = scaled_attention_model(InferenceSession(devices=[CPU(), gpu]), DeviceRef.GPU())
    check_scaled_attention(model, gpu, FP8_GPU_TOL)
