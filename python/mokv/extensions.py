"""Build and load mokv's Python extension modules written in Mojo (mojo/python_ext/).

Each module is one source file, `<name>.mojo`, built on first use and cached by
content: `<cache>/ext/<key>/<name>.so`, where the key is a SHA-256 over the module's
source, the CPU's feature flags (see `_host_cpu`), this interpreter's prefix (a `mojo
build` shared library carries an absolute RUNPATH into the environment that built it)
and, for a module that imports the mokv kernel package, that precompiled package (whose
directory name is the digest of mojo/mokv/). A module that does not import it
(`mokv_hash_ext`) skips that package's build and compiles in seconds. Racing builders
each write a private file and rename it into place.

`mojo.importer` is not used: it caches next to the sources (inside site-packages for
an installed wheel) and cannot pass `-I` for the mokv package.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from types import ModuleType

from .mojo_package import _clean_env, _mojo_binary, cache_dir, kernels_path


def _ext_sources() -> Path:
    """mokv/mojo_ext/ in an installed wheel, else mojo/python_ext/ of the checkout."""
    package = Path(__file__).resolve().parent  # .../mokv
    installed = package / "mojo_ext"
    return installed if installed.is_dir() else package.parents[1] / "mojo" / "python_ext"


EXT_SOURCE_DIR = _ext_sources()


@functools.cache
def _host_cpu() -> bytes:
    """The CPU's feature flags: `mojo build` compiles for the building CPU (`mokv_hash_ext`
    uses the SHA instructions only if it has them), so a cache shared between machines
    must not hand one CPU's build to another. MAX's virtual CPU target is not followed:
    these modules run in this process, on this CPU (as MAX's own compiles whose code
    runs in the compiling process ignore it), and a build for a newer CPU would not."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _key(source: Path, package: Path | None) -> str:
    h = hashlib.sha256(source.read_bytes() + b"\0" + sys.prefix.encode() + b"\0" + _host_cpu())
    if package is not None:
        h.update(b"\0" + str(package).encode())
    return h.hexdigest()


def build(name: str, imports_kernels: bool = False) -> Path:
    """Builds module `name` unless the cache holds one for its current source.

    `imports_kernels`: the module imports the mokv kernel package (built first if needed)."""
    source = EXT_SOURCE_DIR / f"{name}.mojo"
    package = kernels_path() if imports_kernels else None
    out_dir = cache_dir() / "ext" / _key(source, package)
    target = out_dir / f"{name}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir))
    tmp = tmp_dir / target.name
    include = ["-I", str(package.parent)] if package is not None else []
    try:
        proc = subprocess.run(
            [
                _mojo_binary(),
                "build",
                str(source),
                "--emit",
                "shared-lib",
                *include,
                "-o",
                str(tmp),
            ],
            capture_output=True,
            text=True,
            env=_clean_env(),
            cwd=tmp_dir,
        )
        if proc.returncode != 0 or not tmp.is_file():
            raise RuntimeError(
                f"`mojo build {source.name}` failed (rc={proc.returncode}):\n"
                f"{proc.stdout}\n{proc.stderr}"
            )
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return target


_ENV_SET_BY_MOJO = ("PYTHONPATH", "PYTHONEXECUTABLE", "PYTHONHOME", "MOJO_PYTHON_LIBRARY")
"""Loading a Mojo extension sets these in the C-level environment (PYTHONPATH=":",
PYTHONEXECUTABLE=the system python); a child process started without an explicit `env`
would inherit them, and a venv's python then no longer finds its site-packages."""


def _restore_c_environment() -> None:
    for key in _ENV_SET_BY_MOJO:
        if key in os.environ:  # Python's copy: what the process started with
            os.putenv(key, os.environ[key])
        else:
            os.unsetenv(key)


@functools.cache
def load(name: str, imports_kernels: bool = False) -> ModuleType:
    """Module `name` (built on the first call of a process if needed; see `build`)."""
    path = build(name, imports_kernels)
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    with warnings.catch_warnings():  # PythonModuleBuilder's types carry no __module__ (1.2)
        warnings.filterwarnings("ignore", "builtin type .* has no __module__", DeprecationWarning)
        module = importlib.util.module_from_spec(spec)  # runs PyInit_<name>
        loader.exec_module(module)
    _restore_c_environment()
    return module
