"""Every mokv op compiles for a GPU through MAX's virtual (compile-only) devices.

Virtual-device mode is process-global, so each target builds in a subprocess
(`_virtual_gpu_build.py`): constructor + store_kv + fused_qkv_matmul (plain and RoPE)
+ flash_attention (MAX's kernel on mokv's view), for both cache kinds, bf16, pages of
128; for sm_90 also over scaled FP8 pages (paged: the quantizing writes, and attention
through the bfloat16 scratch, whose MAX kernel is the bfloat16 graph's): they add
~60 CPU-s to the sm_90 build (311 against 251, the two builds side by side at load 8,
2026-11-28; a graph of their own took 570 s wall). Loading must succeed and executing must raise MAX's `CompileOnlyExecutionError`.
Each build compiles MAX's attention kernels: ~2 minutes for sm_90, ~1.5 for gfx950 on
the 2-core box. AMD is built for gfx950 (CDNA4): MAX 26.7's attention kernel does not
compile for gfx942 ("MMA shape requires CDNA4 or newer", in its AMD MMA path).

MAX's own layers on a mokv cache compile for sm_90 too (`_virtual_gpu_max_build.py`:
test_max_ops.py's model at GPU sizes). That compile builds MAX's Hopper attention
kernels: 289 s on the 2-core box (2026-11-26, under load), so it is outside `make test`
(marker `max_virtual_gpu`; `make test-virtual-gpu` runs it with the others). MAX's own
MLA layer on a mokv MLA cache (`_virtual_gpu_max_mla_build.py`) is in `make test`: one
layer, its decode graph compiled (273 s of CPU cold, 2026-11-28; two layers of the
prefill-and-decode graph took 1174 s at load 8 to 12).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mokv.ops import kernels_path

SCRIPT = Path(__file__).with_name("_virtual_gpu_build.py")
MAX_SCRIPT = Path(__file__).with_name("_virtual_gpu_max_build.py")
MLA_SCRIPT = Path(__file__).with_name("_virtual_gpu_mla_build.py")
MAX_MLA_SCRIPT = Path(__file__).with_name("_virtual_gpu_max_mla_build.py")


def compiles_then_refuses(script: Path, api: str, arch: str, timeout: int, *args: str) -> str:
    """Runs `script` (with `args`) for a virtual `api`/`arch` device: it must load
    (COMPILED) and then have its execute refused as compile-only. Returns its stdout."""
    # An explicit env (Python's view): importing max.nn set PYTHONPATH=":" and
    # PYTHONEXECUTABLE (the first python3 on PATH) in the C environment, and a child of a
    # venv's python that is not on PATH (`make test`) then lost the venv's site-packages.
    proc = subprocess.run([sys.executable, str(script), api, arch, *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "COMPILED" in proc.stdout, out[-4000:]
    assert "EXEC_REFUSED:CompileOnlyExecutionError" in proc.stdout, out[-4000:]
    return proc.stdout


@pytest.mark.parametrize("api,arch", [("cuda", "sm_90"), ("hip", "gfx950")])
def test_ops_compile_for_virtual_gpu(api: str, arch: str) -> None:
    kernels_path()  # build the package here, not inside the subprocess's timeout
    compiles_then_refuses(SCRIPT, api, arch, 900)


@pytest.mark.parametrize("cache", ["paged", pytest.param("continuous", marks=pytest.mark.max_virtual_gpu)])
def test_ops_over_unscaled_fp8_pages_compile_for_virtual_sm100(cache: str) -> None:
    """mokv's store_kv, fused_qkv_matmul and flash_attention over MAX's unscaled FP8
    pages (MAX's native FP8 attention: e4m3fn queries, a bfloat16 output), paged; the
    continuous cache's store_kv and windowed attention with float32 queries only in
    `make test-virtual-gpu` (another MAX attention kernel). sm_100: MAX 26.7 reads FP8
    pages on no earlier NVIDIA GPU (docs/quantized.md). Cost of both in one graph: 21 min
    wall, 9 min of CPU on the 2-core box at load 8 (2026-11-28), where the bfloat16
    build above took 12 min wall, 4.4 of CPU."""
    kernels_path()
    compiles_then_refuses(SCRIPT, "cuda", "sm_100", 1800, "unscaled_fp8", cache)


def test_attention_over_unscaled_fp8_pages_is_refused_for_virtual_sm90() -> None:
    """On sm_90 MAX 26.7's attention reads no FP8 pages: refused by name at graph build."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "cuda", "sm_90", "unscaled_fp8"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "REFUSED:flash_attention over unscaled FP8 pages on sm_90" in proc.stdout, proc.stdout


@pytest.mark.max_virtual_gpu
def test_max_layers_on_a_mokv_cache_compile_for_virtual_sm90() -> None:
    compiles_then_refuses(MAX_SCRIPT, "cuda", "sm_90", 1800)


def test_mla_ops_compile_for_virtual_sm90() -> None:
    """mokv's MLA store and MAX's MLA decode kernel on the same pages (DeepSeek's shapes,
    bfloat16): 130 s on the 2-core box under load (2026-11-28)."""
    kernels_path()
    compiles_then_refuses(MLA_SCRIPT, "cuda", "sm_90", 1200)


def test_max_s_mla_layer_on_a_mokv_cache_compiles_for_virtual_sm90() -> None:
    """MAX's own LatentAttentionWithRope (deepseekV2's attention: bfloat16 weights, GPU
    kernels only, so no CPU run) on a mokv MLA cache: the graph on mokv's inputs is the
    graph on MAX's own params' inputs in both graph modes, and the decode one compiles
    for sm_90."""
    kernels_path()
    assert "SAME_GRAPH" in compiles_then_refuses(MAX_MLA_SCRIPT, "cuda", "sm_90", 2400)
