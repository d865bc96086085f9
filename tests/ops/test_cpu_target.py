"""What mokv compiles with `mojo` itself follows MAX's virtual CPU target (docs/cpus.md).

The graphs follow it in MAX (docs/cpus.md's example compiles one for `x86-64-v3` and
checks its output); here, the Python extension modules: a build for another CPU is
another cache entry, and, read back with `objdump`, holds no AVX-512 instruction.
"""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
from max.driver import get_virtual_cpu_target, set_virtual_cpu_target

from mokv import extensions
from mokv.mojo_package import mojo_target_flags


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64-v3 is an x86-64 CPU")
def test_extension_modules_build_for_the_virtual_cpu_target() -> None:
    previous = get_virtual_cpu_target()  # a `--cpu-target` run's, else ""
    set_virtual_cpu_target("")
    try:
        assert mojo_target_flags() == []
        host = extensions.build("mokv_hash_ext")
        set_virtual_cpu_target("x86-64-v3")
        assert mojo_target_flags() == ["--target-cpu", "x86-64-v3"]
        avx2 = extensions.build("mokv_hash_ext")
    finally:
        set_virtual_cpu_target(previous)
    assert avx2.is_file() and avx2.parent != host.parent
    objdump = shutil.which("objdump")
    if objdump is not None:
        code = subprocess.run([objdump, "-d", str(avx2)], capture_output=True, text=True, check=True)
        assert "ymm" in code.stdout or "xmm" in code.stdout  # it did read the code
        assert "zmm" not in code.stdout
