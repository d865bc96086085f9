"""Build the Mojo kernel package once and hand its path to every graph.

`max.graph.Graph(custom_extensions=[...])` accepts a source directory too, but then
MAX rebuilds the package in every process (+3 s at `Graph()`, +2 s at session
creation). We precompile once into `<cache>/<sha256 of the sources>/mokv.mojoc`, keyed
by content so an edited source gets a new file, and reuse it across processes. The
file itself must be called `mokv.mojoc`: the graph compiler imports a package by its
file stem, so `mokv-<sha>.mojoc` would make it `import mokv-<sha>` (a syntax error).

Two processes may race to build: each writes a private temporary file and renames it
into place, which is atomic on POSIX, so a reader never sees a half-written package.
A failed `mojo precompile` leaves no file, so the next call simply tries again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def _mojo_sources() -> Path:
    """The Mojo sources: mokv/mojo_src/ in an installed wheel, else mojo/mokv/ of the
    checkout that an editable install points into."""
    package = Path(__file__).resolve().parent  # .../mokv
    installed = package / "mojo_src"
    return installed if installed.is_dir() else package.parents[1] / "mojo" / "mokv"


MOJO_PACKAGE_DIR = _mojo_sources()
"""The Mojo package's source directory (see `_mojo_sources`)."""


def cache_dir() -> Path:
    """Where built packages go: `$MOKV_CACHE_DIR`, else `~/.cache/mokv`."""
    env = os.environ.get("MOKV_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "mokv"


def _mojo_binary() -> str:
    """The `mojo` next to this interpreter (the virtualenv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mojo"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mojo")
    if found is None:
        raise RuntimeError(
            "cannot find the `mojo` compiler: install the `mojo` package into this "
            f"environment (looked next to {sys.executable} and on PATH)"
        )
    return found


def mojo_target_flags() -> list[str]:
    """`mojo build`/`mojo run` flags for the CPU that MAX compiles graphs for.

    MAX 26.7's `max.driver.set_virtual_cpu_target(name)` makes every CPU kernel of a graph,
    MAX's and mokv's, compile for the LLVM CPU `name` instead of this host's; a Mojo
    program run with these flags (the suite's Mojo tests and the docs' Mojo blocks) is
    compiled for the same CPU. No flags while no virtual CPU target is set. mokv's
    extension modules do not take them: they run in this process (`extensions`)."""
    from max.driver import get_virtual_cpu_target

    target = get_virtual_cpu_target()
    return ["--target-cpu", target] if target else []


def _clean_env() -> dict[str, str]:
    """This process's environment, for the `mojo` driver (itself a Python script).

    MAX's native libraries can set `PYTHONPATH=":"` in the C-level environment, which a
    child inherits by default: its empty entries mean "the working directory", where the
    repository's `mojo/` folder would then shadow the `mojo` Python package. Passing
    `os.environ` (Python's own copy, without those changes) and running from a private
    directory avoids both.
    """
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONEXECUTABLE", None)
    return env


def sources_digest(package_dir: Path = MOJO_PACKAGE_DIR) -> str:
    """SHA-256 over every `*.mojo` file's relative path and bytes, in a stable order."""
    h = hashlib.sha256()
    for path in sorted(package_dir.rglob("*.mojo")):
        h.update(str(path.relative_to(package_dir)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def build(package_dir: Path = MOJO_PACKAGE_DIR, out_dir: Path | None = None) -> Path:
    """Precompiles `package_dir` unless a package for its current sources exists."""
    build_dir = (out_dir or cache_dir()) / sources_digest(package_dir)
    target = build_dir / "mokv.mojoc"
    if target.is_file():
        return target
    build_dir.mkdir(parents=True, exist_ok=True)
    # `mojo precompile` records the output file's stem as the package name, so the
    # temporary must also be called mokv.mojoc: build it in a private directory.
    tmp_dir = Path(tempfile.mkdtemp(prefix=".tmp-", dir=build_dir))
    tmp = tmp_dir / "mokv.mojoc"
    try:
        proc = subprocess.run(
            [_mojo_binary(), "precompile", str(package_dir), "-o", str(tmp)],
            capture_output=True,
            text=True,
            env=_clean_env(),
            cwd=tmp_dir,
        )
        if proc.returncode != 0 or not tmp.is_file() or tmp.stat().st_size == 0:
            raise RuntimeError(
                f"`mojo precompile {package_dir}` failed (rc={proc.returncode}):\n"
                f"{proc.stdout}\n{proc.stderr}"
            )
        os.replace(tmp, target)  # atomic: racing builders all end with a complete file
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return target


@functools.cache
def kernels_path() -> Path:
    """Path of the built kernel package, for `Graph(..., custom_extensions=[kernels_path()])`.

    Built on the first call of the process (a few seconds), cached on disk after that.
    """
    return build()
