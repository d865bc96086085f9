"""Keeps one harmless compiler warning about mokv's collections off the terminal.

mokv's collection structs are trivial register types (see `KVCollectionT` in
mojo/mokv/types.mojo: that is what keeps MAX 26.7's GPU code generator from reading a
collection after moving it away). The Mojo code that MAX generates for a graph still
writes `value^` for every opaque value it hands on, and for a trivial type the compiler
prints, once per hand-off:

    warning: transfer from a value of trivial register type 'PagedKVCacheCollection[...]'
    has no effect and can be removed
            <generated line>
               ^

MAX 26.7 has no switch for compiler diagnostics, and the warnings are written by native
code straight to file descriptor 2. So while `InferenceSession.compile` / `load_all`
(which `load` calls) compiles a graph that uses mokv's kernels, descriptor 2 goes to a
temporary file; afterwards everything in it except those warning blocks is written to
the real stderr. `install()` is called by the collection fetchers, so only processes
that build mokv graphs are touched, and graphs without mokv's kernels are compiled as
before. Set `MOKV_COMPILER_WARNINGS=show` to see the compiler's output unfiltered (and
live, which matters if a compile crashes the process).
"""

from __future__ import annotations

import functools
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from max.engine import InferenceSession
from max.graph import Graph

_WARNING = re.compile(
    r"warning: transfer from a value of trivial register type "
    r"'(PagedKVCacheCollection|ContinuousBatchingKVCacheCollection)\["
)

_lock = threading.RLock()  # descriptor 2 is process-wide: one redirection at a time
_depth = 0  # load_all may call compile: only the outermost call redirects


def drop_collection_warnings(text: str) -> str:
    """`text` without the compiler's warning blocks about mokv's collection types.

    A block is the warning line, the generated source line, the caret line and the
    whitespace line that closes it.
    """
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        if _WARNING.match(line):
            skipping = True
        elif skipping and not line.strip():
            skipping = False
        elif not skipping:
            out.append(line)
    return "".join(out)


def _uses_mokv_kernels(model: object) -> bool:
    return isinstance(model, Graph) and any(
        p.name == "mokv.mojoc" for p in model.kernel_libraries_paths
    )


def _filtered(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(compile_fn)
    def wrapper(self: InferenceSession, model: Any, *args: Any, **kwargs: Any) -> Any:
        global _depth
        if not _uses_mokv_kernels(model) or os.environ.get("MOKV_COMPILER_WARNINGS") == "show":
            return compile_fn(self, model, *args, **kwargs)
        with _lock:
            _depth += 1
            if _depth > 1:
                try:
                    return compile_fn(self, model, *args, **kwargs)
                finally:
                    _depth -= 1
            sys.stderr.flush()
            saved = os.dup(2)
            with tempfile.TemporaryFile() as captured:
                os.dup2(captured.fileno(), 2)
                try:
                    return compile_fn(self, model, *args, **kwargs)
                finally:
                    sys.stderr.flush()
                    os.dup2(saved, 2)
                    os.close(saved)
                    _depth -= 1
                    captured.seek(0)
                    rest = drop_collection_warnings(captured.read().decode(errors="replace"))
                    if rest:
                        os.write(2, rest.encode())

    wrapper._mokv_filtered = True  # type: ignore[attr-defined]
    return wrapper


def install() -> None:
    """Filters the collection warnings out of every later compile in this process."""
    with _lock:
        for name in ("compile", "load_all"):
            method = getattr(InferenceSession, name)
            if not getattr(method, "_mokv_filtered", False):
                setattr(InferenceSession, name, _filtered(method))
