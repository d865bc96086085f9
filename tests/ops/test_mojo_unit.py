"""Runs each Mojo unit test file (tests/mojo/test_*.mojo) so that `pytest` covers them.

Mojo 1.2 has no `mojo test`; a `std.testing.TestSuite` file exits non-zero on failure.
The files import `mokv` from the precompiled package, built once per session.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mokv.ops import kernels_path
from mokv.mojo_package import _mojo_binary

MOJO_TESTS = sorted((Path(__file__).resolve().parents[1] / "mojo").glob("test_*.mojo"))


@pytest.mark.parametrize("path", MOJO_TESTS, ids=lambda p: p.name)
def test_mojo_file(path: Path) -> None:
    proc = subprocess.run(
        [_mojo_binary(), "run", "-I", str(kernels_path().parent), str(path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "FAIL" not in proc.stdout.replace("0 failed", ""), proc.stdout[-4000:]
