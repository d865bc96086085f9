"""Runs each Mojo unit test file (tests/mojo/test_*.mojo) so that `pytest` covers them,
and the direct-call decode benchmark on a small shape (it checks its own output).

Mojo 1.2 has no `mojo test`; a `std.testing.TestSuite` file exits non-zero on failure.
The files import `mokv` from the precompiled package, built once per session.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mokv.ops import kernels_path
from mokv.mojo_package import _mojo_binary

ROOT = Path(__file__).resolve().parents[2]
MOJO_TESTS = sorted((ROOT / "tests" / "mojo").glob("test_*.mojo"))


def _mojo_run(*args: str) -> subprocess.CompletedProcess:
    """`mojo run` with the precompiled mokv package on the import path."""
    return subprocess.run(
        [_mojo_binary(), "run", "-I", str(kernels_path().parent), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("path", MOJO_TESTS, ids=lambda p: p.name)
def test_mojo_file(path: Path) -> None:
    proc = _mojo_run(str(path))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "FAIL" not in proc.stdout.replace("0 failed", ""), proc.stdout[-4000:]


def test_decode_direct_benchmark_runs_and_matches_its_reference() -> None:
    """benchmarks/decode_direct.mojo, a GQA 4 bf16 shape over two sequences of 600 cached
    tokens (tiles, splits and a partial tile): it exits non-zero when sequence 0's
    output differs from its float64 reference."""
    defines = ["-D", "KV_HEADS=2", "-D", "GROUP=4", "-D", "DTYPE=bfloat16"]
    proc = _mojo_run(*defines, str(ROOT / "benchmarks" / "decode_direct.mojo"), "600", "2", "3")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "median_ms" in proc.stdout and "context 600 batch 2" in proc.stdout, proc.stdout
