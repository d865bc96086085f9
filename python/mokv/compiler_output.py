"""Keeps one harmless compiler warning about mokv's collections off the terminal, inside
a scope the caller opens.

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
code straight to file descriptor 2. So around the compile of a graph that uses mokv's
kernels, a caller may write

    with mokv.filter_collection_warnings():
        model = session.load(graph)

and while the block runs, descriptor 2 goes to a temporary file; afterwards everything
in it except those warning blocks is written to the real stderr. Descriptor 2 belongs
to the whole process, so one block runs at a time (other threads entering one wait),
and output that other threads write meanwhile comes out when the block ends. Nothing
is patched and nothing outside the block is touched. Set `MOKV_COMPILER_WARNINGS=show`
to make the block a no-op: the compiler's output unfiltered and live, which matters if
a compile crashes the process.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

_WARNING = re.compile(
    r"warning: transfer from a value of trivial register type "
    r"'(PagedKVCacheCollection|ContinuousBatchingKVCacheCollection)\["
)

_lock = threading.RLock()  # descriptor 2 is process-wide: one redirection at a time
_depth = 0  # a block inside a block (same thread) adds no second redirection


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


@contextlib.contextmanager
def filter_collection_warnings() -> Iterator[None]:
    """Within the block, the compiler's warnings about mokv's collection types are
    dropped from file descriptor 2; everything else written there comes out at the end
    (see the module docstring)."""
    global _depth
    if os.environ.get("MOKV_COMPILER_WARNINGS") == "show":
        yield
        return
    with _lock:
        _depth += 1
        try:
            if _depth > 1:
                yield
                return
            sys.stderr.flush()
            saved = os.dup(2)
            with tempfile.TemporaryFile() as captured:
                os.dup2(captured.fileno(), 2)
                try:
                    yield
                finally:
                    sys.stderr.flush()
                    os.dup2(saved, 2)
                    os.close(saved)
                    captured.seek(0)
                    rest = drop_collection_warnings(captured.read().decode(errors="replace"))
                    if rest:
                        os.write(2, rest.encode())
        finally:
            _depth -= 1
