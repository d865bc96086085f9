"""The environment for a child Python process that a test starts."""

from __future__ import annotations

import os

# MAX's native code leaves PYTHONPATH=":", PYTHONEXECUTABLE and MOJO_PYTHON_LIBRARY in the C
# environment once it is imported, and a child started without `env=` inherits those: a child of
# a venv's python that is not on PATH (`make test`) then loses the venv's site-packages.
_DROP = ("PYTHONEXECUTABLE", "PYTHONPATH", "MOJO_PYTHON_LIBRARY")


def child_env(**extra: str) -> dict[str, str]:
    """Python's view of the environment, less what MAX's import sets, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if k not in _DROP}, **extra}
