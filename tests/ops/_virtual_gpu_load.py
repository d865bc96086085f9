"""What the virtual-GPU build scripts print after building their graph (test_virtual_gpu.py
reads it): COMPILED <seconds> once the session loaded it, then EXEC_REFUSED:<exception
type> once executing it failed, as it must on a compile-only device."""

from __future__ import annotations

import time

import numpy as np
from max.driver import Buffer
from max.engine import InferenceSession
from max.graph import Graph


def load_then_execute(session: InferenceSession, graph: Graph, **load_args) -> None:
    start = time.perf_counter()
    model = session.load(graph, **load_args)
    print(f"COMPILED {time.perf_counter() - start:.0f}", flush=True)
    try:
        model.execute(Buffer.from_numpy(np.zeros(1, np.float32)))
    except Exception as exc:  # noqa: BLE001 - the type is what the test checks
        print(f"EXEC_REFUSED:{type(exc).__name__}", flush=True)
