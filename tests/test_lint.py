"""The repository's lint and types: `ruff check` and `mypy` over the package, the tests,
the benchmarks, the graphs and the examples, and `ruff format --check` over the package,
configured in pyproject.toml (mypy reads every body of the package, and the rest where
it is annotated). They run in the suite so that a change that breaks them fails `make
test` like any other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [["ruff", "check", "."], ["ruff", "format", "--check", "python/"], ["mypy"]],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_repository_is_clean(command: list[str]) -> None:
    # Python's view of the environment: MAX's native code, once a test loaded it, leaves
    # PYTHONEXECUTABLE in the C one, which would start the tools outside this venv.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONEXECUTABLE", "PYTHONPATH")}
    proc = subprocess.run(
        [str(TOOLS / command[0]), *command[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
