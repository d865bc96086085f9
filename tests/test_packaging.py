"""A non-editable install carries the Mojo sources, and mokv finds them there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from mokv.extensions import EXT_SOURCE_DIR
from mokv.mojo_package import MOJO_PACKAGE_DIR, sources_digest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_mojo_sources_and_extension_finds_them(tmp_path: Path) -> None:
    # Build from a copy so that setuptools' build/ and egg-info stay out of the checkout
    # (pip fetches the build backend, as `pip install -e .` does).
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src)
    for tree in ("python", "graphs", "mojo"):
        shutil.copytree(ROOT / tree, src / tree, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "-w", str(wheels), str(src)], check=True)
    wheel = next(wheels.glob("mokv-*.whl"))
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".mojo")}
    expected = {f"mokv/mojo_src/{p.relative_to(MOJO_PACKAGE_DIR).as_posix()}"
                for p in MOJO_PACKAGE_DIR.rglob("*.mojo")}
    expected |= {f"mokv/mojo_ext/{p.name}" for p in EXT_SOURCE_DIR.glob("*.mojo")}
    assert shipped == expected

    # Installed (not editable), mokv compiles the shipped copy: same sources, same cache key.
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(wheel)], check=True)
    probe = ("import mokv.mojo_package as e, mokv.extensions as n; "
             "print(e.MOJO_PACKAGE_DIR); print(e.sources_digest()); print(n.EXT_SOURCE_DIR)")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(site)}, cwd=tmp_path).stdout.split()
    assert out == [str(site / "mokv" / "mojo_src"), sources_digest(),
                   str(site / "mokv" / "mojo_ext")]
