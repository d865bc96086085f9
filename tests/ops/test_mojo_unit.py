"""Runs each Mojo unit test file (tests/mojo/test_*.mojo) so that `pytest` covers them,
and the direct-call decode benchmark on a small shape (it checks its own output).

Mojo 1.2 has no `mojo test`; a `std.testing.TestSuite` file exits non-zero on failure.
The files import `mokv` from the precompiled package, built once per session.

The files that run CPU kernels run on each kind of CPU path (kernels/cpu.mojo): the
host's own, the portable paths forced by the define, and, on an x86-64 host with AVX2,
a build for x86-64-v3 (AVX2 and FMA, no AVX-512: the instructions an AVX2-only host
has, so nothing AVX-512 can slip into the portable paths). Builds for the targets this
host cannot run (an Intel AVX-512 server core and Zen 4, which take the tuning table's
other rows, and aarch64) are compiled without running.
"""

from __future__ import annotations

import platform
import subprocess
import tempfile
from pathlib import Path

import pytest
from mokv.mojo_package import _clean_env, _mojo_binary, mojo_target_flags
from mokv.ops import kernels_path
from mokv.ops.cpu_paths import PORTABLE_DEFINE, host_cpu_flags, host_takes_portable_paths

ROOT = Path(__file__).resolve().parents[2]
MOJO_TESTS = sorted((ROOT / "tests" / "mojo").glob("test_*.mojo"))
KERNEL_TESTS = {"test_exp2.mojo", "test_decode_forms.mojo", "test_fused_qkv.mojo", "test_manager_kernels.mojo"}
DECODE_DIRECT = ROOT / "benchmarks" / "decode_direct.mojo"

CPU_PATHS = {
    "native": [],
    "portable": ["-D", f"{PORTABLE_DEFINE}=true"],
    "x86-64-v3": ["--target-cpu", "x86-64-v3"],
}
CROSS_TARGETS = {
    "sapphirerapids": ["--target-cpu", "sapphirerapids"],
    "znver4": ["--target-cpu", "znver4"],
    "aarch64": ["--target-triple", "aarch64-unknown-linux-gnu"],
}


def _skip_unrunnable(path_name: str) -> None:
    if path_name == "portable" and host_takes_portable_paths():
        pytest.skip("this host's native CPU paths are the portable ones")
    if path_name == "x86-64-v3" and (platform.machine() != "x86_64" or "avx2" not in host_cpu_flags()):
        pytest.skip("x86-64-v3 code runs on an x86-64 host with AVX2 only")


def _mojo(command: str, *args: str) -> subprocess.CompletedProcess:
    """`mojo <command>` with the precompiled mokv package on the import path, for the CPU
    that graphs compile for (MAX's virtual CPU target, if set) unless `args` name one."""
    named = {"--target-cpu", "--target-triple"} & set(args)
    return subprocess.run(
        [_mojo_binary(), command, "-I", str(kernels_path().parent),
         *([] if named else mojo_target_flags()), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=_clean_env(),  # the driver is a Python script: no PYTHONPATH of MAX's
        cwd=tempfile.gettempdir(),  # nor the repository's mojo/ folder as its `mojo`
    )


def _cases() -> list:
    cases = []
    for path in MOJO_TESTS:
        for name in CPU_PATHS if path.name in KERNEL_TESTS else ["native"]:
            cases.append(pytest.param(path, name, id=f"{path.name}-{name}"))
    return cases


@pytest.mark.parametrize("path,cpu_path", _cases())
def test_mojo_file(path: Path, cpu_path: str) -> None:
    _skip_unrunnable(cpu_path)
    proc = _mojo("run", *CPU_PATHS[cpu_path], str(path))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "FAIL" not in proc.stdout.replace("0 failed", ""), proc.stdout[-4000:]


@pytest.mark.parametrize("cpu_path", list(CPU_PATHS))
def test_decode_direct_benchmark_runs_and_matches_its_reference(cpu_path: str) -> None:
    """benchmarks/decode_direct.mojo, a GQA 4 bf16 shape over two sequences of 600 cached
    tokens (tiles, splits and a partial tile): it exits non-zero when sequence 0's
    output differs from its float64 reference."""
    _skip_unrunnable(cpu_path)
    defines = ["-D", "KV_HEADS=2", "-D", "GROUP=4", "-D", "DTYPE=bfloat16"]
    proc = _mojo("run", *CPU_PATHS[cpu_path], *defines, str(DECODE_DIRECT), "600", "2", "3")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "median_ms" in proc.stdout and "context 600 batch 2" in proc.stdout, proc.stdout


@pytest.mark.parametrize("target", list(CROSS_TARGETS))
def test_kernels_build_for_other_cpus(tmp_path: Path, target: str) -> None:
    """The CPU kernels compile, without running, for the targets of the tuning table's
    other rows and for aarch64: the attention over bf16 and f32 caches (the decode
    benchmark) and the fused QKV projection (its unit test)."""
    builds = [
        (DECODE_DIRECT, ["-D", "DTYPE=bfloat16"]),
        (DECODE_DIRECT, ["-D", "DTYPE=float32"]),
        (ROOT / "tests" / "mojo" / "test_fused_qkv.mojo", []),
    ]
    for i, (source, defines) in enumerate(builds):
        out = tmp_path / f"{i}.o"
        proc = _mojo("build", *CROSS_TARGETS[target], *defines, "--emit", "object", "-o", str(out), str(source))
        assert proc.returncode == 0 and out.stat().st_size > 0, (proc.stdout + proc.stderr)[-4000:]
