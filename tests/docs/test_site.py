"""The docs site builds with warnings as errors (`make docs` does the same into site/).

The pages' code blocks run elsewhere: conftest.py collects README.md and docs/*.md.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.fail("mkdocs is missing: install the test extra (pip install -e '.[test]')")
    proc = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's banner
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    for page in sorted((ROOT / "docs").glob("*.md")):
        name = "index.html" if page.stem == "index" else f"{page.stem}/index.html"
        assert (tmp_path / "site" / name).is_file(), f"{page.name} was not built"


def test_readme_links_into_docs_exist() -> None:
    """Every docs/ page the README links to is there (the site does not see the README)."""
    readme = (ROOT / "README.md").read_text()
    targets = set(re.findall(r"\]\((docs/[^)#\s]+)", readme))
    assert targets, "the README links into docs/"
    missing = sorted(t for t in targets if not (ROOT / t).is_file())
    assert not missing, missing
