"""Which test compiles which MAX graph, and for how long: a log of every
`InferenceSession.compile` in a pytest run and in the Python processes its tests start.

    MOKV_COMPILE_LOG=/tmp/c.jsonl PYTHONPATH=benchmarks/compile_log \\
        .venv/bin/python -m pytest -p compile_log -q [tests...]
    python benchmarks/compile_log/compile_log.py /tmp/c.jsonl   # the tables

Point `MODULAR_CACHE_DIR` (and `MOKV_CACHE_DIR`) at an empty directory for a cold run
without touching the shared caches. One JSON line per compile: the test running
(`MOKV_COMPILE_LOG_TEST`, inherited by subprocesses), the graph's name, a fingerprint
of its MLIR text (equal text: MAX's cache entry is shared, if the Mojo defines agree
too), and the seconds; one line per test with its wall time. A measuring tool, never
part of `make test`: it replaces `InferenceSession.compile` in the processes it runs in
(sitecustomize.py, beside this file, installs it where Python starts).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Generator
from typing import Any

LOG_ENV, TEST_ENV = "MOKV_COMPILE_LOG", "MOKV_COMPILE_LOG_TEST"


def _write(record: dict[str, Any]) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as log:  # one short appended line: processes do not interleave
            log.write(json.dumps(record) + "\n")


def install(api: Any) -> None:
    """Wraps `api.InferenceSession.compile` (module `max.engine.api`), once."""
    original: Callable[..., Any] = api.InferenceSession.compile
    if getattr(original, "logs_compiles", False):
        return

    def compile(self: Any, model: Any, **kwargs: Any) -> Any:
        text = str(model)
        start = time.perf_counter()
        try:
            return original(self, model, **kwargs)
        finally:
            _write(
                {
                    "test": os.environ.get(TEST_ENV, "?"),
                    "pid": os.getpid(),
                    "name": str(getattr(model, "name", type(model).__name__)),
                    "graph": hashlib.sha1(text.encode()).hexdigest()[:12],
                    "s": round(time.perf_counter() - start, 3),
                }
            )

    compile.logs_compiles = True  # type: ignore[attr-defined]
    api.InferenceSession.compile = compile


try:  # as a pytest plugin (`-p compile_log`)
    import pytest
except ImportError:  # a subprocess without pytest only needs `install`
    pass
else:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: Any, nextitem: Any) -> Generator[None, None, None]:
        os.environ[TEST_ENV] = item.nodeid
        start = time.perf_counter()
        yield
        _write(
            {
                "done": item.nodeid,
                "s": round(time.perf_counter() - start, 3),
                "load": os.getloadavg()[0],
            }
        )
        os.environ[TEST_ENV] = "(between tests)"


def report(lines: list[dict[str, Any]]) -> str:
    """Per graph: compiles, the first one's seconds, the files; per test file: wall
    seconds, compiles, distinct graphs, and graphs no earlier file compiled."""
    compiles = [r for r in lines if "graph" in r]
    graphs: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in compiles:
        graphs[r["graph"]].append(r)
    out = [
        f"{len(compiles)} compiles of {len(graphs)} distinct graphs",
        "",
        "graph        name                                 compiles  first s  files",
    ]
    for fingerprint, rs in graphs.items():
        where = collections.Counter(r["test"].split("::")[0] for r in rs)
        out.append(
            f"{fingerprint} {rs[0]['name'][:36]:36} {len(rs):8} {rs[0]['s']:8.1f}  "
            + ", ".join(f"{f} x{n}" for f, n in where.items())
        )
    seen: set[str] = set()
    files: dict[str, dict[str, Any]] = {}
    for r in lines:
        name = (r.get("done") or r["test"]).split("::")[0]
        f = files.setdefault(name, {"s": 0.0, "compiles": 0, "graphs": set(), "new": 0})
        if "done" in r:
            f["s"] += r["s"]
        else:
            f["compiles"] += 1
            f["graphs"].add(r["graph"])
            f["new"] += r["graph"] not in seen
            seen.add(r["graph"])
    out += ["", "wall s  compiles  graphs  new  file"]
    for name, f in sorted(files.items(), key=lambda kv: -kv[1]["s"]):
        out.append(f"{f['s']:7.1f} {f['compiles']:9} {len(f['graphs']):7} {f['new']:4}  {name}")
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as log:
        print(report([json.loads(line) for line in log]))
