"""Build and load `mokv_manager_ext`, the Python extension module written in Mojo.

Like the kernel package (`mokv.mojo_package`), the module is built on first use and
cached by content: `<cache>/<key>/mokv_manager_ext.so`, where the key is a SHA-256 over
the extension's sources, the precompiled mokv package it imports (whose directory name
is the digest of mojo/mokv/) and this interpreter's prefix (a `mojo build` shared
library carries an absolute RUNPATH into the environment that built it). Racing
builders each write a private file and rename it into place.

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

from ..mojo_package import _clean_env, _mojo_binary, cache_dir, kernels_path

MODULE_NAME = "mokv_manager_ext"


def _ext_sources() -> Path:
    """mokv/mojo_ext/ in an installed wheel, else mojo/python_ext/ of the checkout."""
    package = Path(__file__).resolve().parents[1]  # .../mokv
    installed = package / "mojo_ext"
    return installed if installed.is_dir() else package.parents[1] / "mojo" / "python_ext"


EXT_SOURCE_DIR = _ext_sources()


def _key(package: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(EXT_SOURCE_DIR.rglob("*.mojo")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(str(package).encode() + b"\0" + sys.prefix.encode())
    return h.hexdigest()


def build() -> Path:
    """Builds the extension unless the cache holds one for the current sources."""
    package = kernels_path()  # the precompiled mokv package the module imports
    out_dir = cache_dir() / "ext" / _key(package)
    target = out_dir / f"{MODULE_NAME}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir))
    tmp = tmp_dir / target.name
    try:
        proc = subprocess.run(
            [_mojo_binary(), "build", str(EXT_SOURCE_DIR / f"{MODULE_NAME}.mojo"),
             "--emit", "shared-lib", "-I", str(package.parent), "-o", str(tmp)],
            capture_output=True, text=True, env=_clean_env(), cwd=tmp_dir,
        )
        if proc.returncode != 0 or not tmp.is_file():
            raise RuntimeError(
                f"`mojo build {MODULE_NAME}.mojo` failed (rc={proc.returncode}):\n"
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
def load() -> ModuleType:
    """The `mokv_manager_ext` module (built on the first call of a process if needed)."""
    path = build()
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
    assert spec is not None
    with warnings.catch_warnings():  # PythonModuleBuilder's types carry no __module__ (1.2)
        warnings.filterwarnings("ignore", "builtin type .* has no __module__", DeprecationWarning)
        module = importlib.util.module_from_spec(spec)  # runs PyInit_mokv_manager_ext
        loader.exec_module(module)
    _restore_c_environment()
    return module
