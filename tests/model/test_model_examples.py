"""The examples run as scripts, in a fresh interpreter, as a user would run them."""

import subprocess
import sys
from pathlib import Path

import mokv_graphs as mg
import pytest

from ..child_env import child_env
from .conftest import PAGE_SIZE

REPO_ROOT = Path(__file__).resolve().parents[2]

WITH_SUITE_DEFINES = (
    "import runpy, sys; from max.driver import CPU; from max.engine import InferenceSession; "
    "from tests.mojo_defines import set_default_mokv_defines; "
    "set_default_mokv_defines(InferenceSession(devices=[CPU()])); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)
"""`python -c WITH_SUITE_DEFINES SCRIPT ARGS...` runs SCRIPT as `python SCRIPT ARGS...` does,
with the suite's Mojo defines set first (tests/mojo_defines.py), so that the graphs it
compiles share MAX's cache entries with the test process's."""


# The paged strategy only: the continuous layout's ops compile for a virtual sm_90 in
# tests/ops/test_virtual_gpu.py, and each cold decoder build here costs over a minute.
@pytest.mark.parametrize("strategy", ["paged"])
def test_compile_only_example(tmp_path, strategy):
    """Cross-compiles the decoder for a virtual H100 and refuses to execute it."""
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "compile_only.py"),
         "--strategy", strategy, "--out", str(tmp_path / "decoder.mef")],
        capture_output=True, text=True, timeout=900, cwd=REPO_ROOT, env=child_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"NullKVCacheManager, {strategy} layout" in proc.stdout
    assert f"mokv.kv_collection_ctor.{strategy}" in proc.stdout
    assert "execute raised CompileOnlyExecutionError" in proc.stdout
    assert (tmp_path / "decoder.mef").stat().st_size > 0
    assert "warning:" not in proc.stderr, proc.stderr


def test_generate_example(tmp_path, config, weights):
    """The example on a Hugging Face checkpoint directory of the model tests' decoder, with
    their page size: its graph is the paged model's (conftest.py), which MAX compiled
    already, where the default `DecoderConfig()` would cost a compile of its own."""
    checkpoint = mg.save_checkpoint(tmp_path / "checkpoint", config, weights)
    proc = subprocess.run(
        [sys.executable, "-c", WITH_SUITE_DEFINES, str(REPO_ROOT / "examples" / "generate.py"),
         "--requests", "6",
         "--weights", str(checkpoint), "--page-size", str(PAGE_SIZE), "--pages", "160"],
        capture_output=True, text=True, timeout=900, cwd=REPO_ROOT, env=child_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Compiled mokv_decoder_paged" in proc.stdout
    assert "matches the uncached recompute" in proc.stdout


def test_quickstart_example():
    """The two manager flows of MAX's documentation (paged with two replicas, continuous
    with sequence ids) run and leave the state they print."""
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "quickstart.py")],
        check=False, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, env=child_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ctx3 shares the system prompt" in proc.stdout and "start_idx=32" in proc.stdout
    assert "after release: 4 free slots" in proc.stdout
