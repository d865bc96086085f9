"""Installs compile_log.py's wrapper in every Python process started with this folder on
PYTHONPATH, when `max.engine.api` is first imported (never importing MAX itself)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any


class _InstallOnImport(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != "max.engine.api":
            return None
        sys.meta_path.remove(self)  # find the real module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        load = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            # compile_log.py beside this file, on PYTHONPATH as this file is
            importlib.import_module("compile_log").install(module)

        loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _InstallOnImport())
