"""Which of mokv's CPU kernel paths a session's graphs take (mojo/mokv/kernels/cpu.mojo).

The kernels pick their paths by the build target's features when MAX compiles a graph:
16-lane AVX-512 forms where the CPU has AVX-512F, the portable 8-lane forms elsewhere
(x86-64 with AVX2, Arm). `portable_cpu_paths` makes graphs compile the portable
forms on any host, so that an AVX-512 machine tests and measures the paths an AVX2 one
runs; a server never needs it. MAX's `max.driver.set_virtual_cpu_target` goes further:
every CPU kernel of a graph, MAX's too, compiles for the CPU it names (`znver3`: the AVX2
code a Zen 3 host runs), and the suite's Mojo programs follow it (`mojo_target_flags`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from max.engine import InferenceSession

from ..mojo_package import mojo_target_flags

PORTABLE_DEFINE = "MOKV_CPU_PORTABLE"
"""The compile-time define the Mojo kernels read (`mojo run -D MOKV_CPU_PORTABLE=true`)."""


@contextmanager
def portable_cpu_paths(
    session: InferenceSession, portable: bool = True
) -> Iterator[InferenceSession]:
    """Graphs compiled inside the block take mokv's portable CPU paths (`portable`) or the
    host's own (`False`); after the block, the host's own.

        with mokv.ops.portable_cpu_paths(session):
            model = session.load(graph)     # keeps the portable paths for good

    It sets the kernels' define through MAX 26.7's `InferenceSession._set_mojo_define`
    (private: MAX's own pipelines set their kernel defines through it), whose defines hold
    for the whole process and are read when a graph compiles, so inside the block every
    session's compiles take the paths, not only `session`'s. MAX keys its compiled-model
    cache on the define: portable and native builds of one graph never mix.
    """
    if not isinstance(session, InferenceSession):
        raise TypeError(
            f"session must be a max.engine.InferenceSession, got {type(session).__name__}"
        )
    if not isinstance(portable, bool):
        raise TypeError(f"portable must be a bool, got {portable!r}")
    session._set_mojo_define(PORTABLE_DEFINE, "true" if portable else "false")
    try:
        yield session
    finally:
        session._set_mojo_define(PORTABLE_DEFINE, "false")


def host_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This host's CPU feature flags (Linux's `/proc/cpuinfo`; empty where it has none)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86 / Arm
            return frozenset(value.split())
    return frozenset()


def host_takes_portable_paths() -> bool:
    """Whether graphs compiled on this host take the portable paths anyway: it has no
    AVX-512F and no virtual CPU target is set (whose features this cannot tell)."""
    return not mojo_target_flags() and "avx512f" not in host_cpu_flags()
