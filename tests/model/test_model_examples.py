"""The examples run as scripts, in a fresh interpreter, as a user would run them."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


# The paged strategy only: the continuous layout's ops compile for a virtual sm_90 in
# tests/ops/test_virtual_gpu.py, and each cold decoder build here costs over a minute.
@pytest.mark.parametrize("strategy", ["paged"])
def test_compile_only_example(tmp_path, strategy):
    """Cross-compiles the decoder for a virtual H100 and refuses to execute it."""
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "compile_only.py"),
         "--strategy", strategy, "--out", str(tmp_path / "decoder.mef")],
        capture_output=True, text=True, timeout=900, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"NullKVCacheManager, {strategy} layout" in proc.stdout
    assert f"mokv.kv_collection_ctor.{strategy}" in proc.stdout
    assert "execute raised CompileOnlyExecutionError" in proc.stdout
    assert (tmp_path / "decoder.mef").stat().st_size > 0
    assert "warning:" not in proc.stderr, proc.stderr


def test_generate_example(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "generate.py"), "--requests", "6"],
        capture_output=True, text=True, timeout=900, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "matches the uncached recompute" in proc.stdout


def test_quickstart_example():
    """The two manager flows of MAX's documentation (paged with two replicas, continuous
    with sequence ids) run and leave the state they print."""
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "quickstart.py")],
        check=False, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ctx3 shares the system prompt" in proc.stdout and "start_idx=32" in proc.stdout
    assert "after release: 4 free slots" in proc.stdout
