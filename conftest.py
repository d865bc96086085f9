"""Runs the code blocks of README.md and docs/*.md as tests (Sybil), gives every test
and page one set of mokv's Mojo defines (tests/mojo_defines.py), and takes the suite's
`--cpu-target NAME` option: every CPU kernel, MAX's and mokv's, compiled for the LLVM CPU
NAME and run on this host (`pytest --cpu-target znver3` on an AVX-512 machine runs the
code an AVX2-only AMD Zen 3 runs; docs/cpus.md).

Every ```python block runs, in order, in one namespace per file, so a page reads as one
program; a failing block is reported as `docs/PAGE.md::line:N`. Every ```mojo block is a
whole program: it is written to a temporary file and run with `mojo run` against mokv's
precompiled Mojo package (as tests/ops/test_mojo_unit.py runs tests/mojo/). Blocks fenced
as ```sh, ```text or ```toml are commands, output or configuration and are not run.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest
from max.driver import CPU
from max.engine import InferenceSession
from sybil import Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser

from tests.mojo_defines import set_default_mokv_defines

CPU_TARGET_SITE = Path(__file__).resolve().parent / "tests" / "cpu_target_site"
"""Its sitecustomize.py sets the target in the Python processes that tests start."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-target", default="", metavar="NAME",
        help="compile every CPU kernel (MAX's and mokv's) for the LLVM CPU NAME, e.g. znver3 "
             "(AVX2, no AVX-512), and run it here (max.driver.set_virtual_cpu_target)",
    )


def pytest_configure(config: pytest.Config) -> None:
    target = config.getoption("--cpu-target")
    if target:
        from max.driver import set_virtual_cpu_target

        set_virtual_cpu_target(target)  # before anything compiles
        os.environ["MOKV_TEST_CPU_TARGET"] = target
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(CPU_TARGET_SITE), os.environ.get("PYTHONPATH")) if p
        )


@pytest.fixture(scope="session", autouse=True)
def default_mokv_defines() -> None:
    """Before any test or page compiles a graph: see tests/mojo_defines.py."""
    set_default_mokv_defines(InferenceSession(devices=[CPU()]))


def run_mojo(example) -> None:
    """Runs one ```mojo block as a program; its exit status and output are the test."""
    from mokv.mojo_package import _mojo_binary, mojo_target_flags
    from mokv.ops import kernels_path

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "example.mojo"
        source.write_text(example.parsed)
        proc = subprocess.run(
            [_mojo_binary(), "run", *mojo_target_flags(), "-I", str(kernels_path().parent), str(source)],
            check=False, capture_output=True, text=True, timeout=600,
        )
    if proc.returncode != 0:
        raise AssertionError(
            f"mojo run of the block at line {example.line} exited {proc.returncode}:\n"
            + (proc.stdout + proc.stderr)[-4000:]
        )


def close_managers(namespace: dict) -> None:
    """A page that fails half-way may leave a publishing manager open: close it."""
    for value in list(namespace.values()):
        if type(value).__name__ == "PagedKVCacheManager":
            value.close()


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), CodeBlockParser(language="mojo", evaluator=run_mojo)],
    patterns=["README.md", "docs/*.md"],
    teardown=close_managers,
).pytest()
