"""MAX's virtual CPU target and what mokv compiles with `mojo` (docs/cpus.md).

Graphs follow the target in MAX (docs/cpus.md's example compiles one for `x86-64-v3`
and checks its output); the suite's Mojo programs take it from `mojo_target_flags`. The
Python extension modules must not: they run in this process, so a build for a CPU newer
than this one would die on its first instruction this CPU lacks.
"""

from __future__ import annotations

import platform

import pytest
from max.driver import get_virtual_cpu_target, set_virtual_cpu_target
from mokv import extensions
from mokv.mojo_package import mojo_target_flags


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 CPU names")
@pytest.mark.parametrize("target", ["x86-64-v3", "znver5"])
def test_extension_modules_build_for_this_cpu_whatever_the_target(target: str) -> None:
    previous = get_virtual_cpu_target()  # a `--cpu-target` run's, else ""
    set_virtual_cpu_target("")
    try:
        assert mojo_target_flags() == []
        host = extensions.build("mokv_hash_ext")
        set_virtual_cpu_target(target)
        assert mojo_target_flags() == ["--target-cpu", target]
        under_target = extensions.build("mokv_hash_ext")
    finally:
        set_virtual_cpu_target(previous)
    assert under_target == host
