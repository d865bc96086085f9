"""One set of mokv's Mojo defines for every process of the suite that compiles graphs.

MAX keys its compiled-model cache on the process's Mojo defines, and a define once set
cannot be unset. The op tests and docs/cpus.md set mokv's (and put "false" back after
each build), so a graph compiled before them and the same graph compiled after them,
or in a test's subprocess, would miss each other's cache entry (a cold suite compiled
the docs' decoder twice, ~65 s). Every compiling process sets them to "false" first.
"""

from max.engine import InferenceSession
from mokv.ops.cpu_paths import PORTABLE_DEFINE

MAX_KERNELS_DEFINE = "MOKV_MAX_KERNELS"
"""The define that makes mokv's attention op run MAX's kernel on a CPU (tests/ops)."""


def set_default_mokv_defines(session: InferenceSession) -> None:
    """Sets mokv's defines to their defaults, for every session of this process."""
    for define in (PORTABLE_DEFINE, MAX_KERNELS_DEFINE):
        session._set_mojo_define(define, "false")
