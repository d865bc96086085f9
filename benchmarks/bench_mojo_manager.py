"""Host cost of the Mojo ContinuousBatchingKVCacheManager, from Mojo and from Python.

* From Mojo: `bench_mojo_manager.mojo` (run with `mojo run`) times claim(1), fetch,
  step (by collection) and release, a 32-sequence fetch + step, and 8 worker threads
  running claim -> fetch -> step -> release lifecycles on one manager.
* From Python: the same calls on `mokv.MojoContinuousBatchingKVCacheManager` and on
  the Python `mokv.ContinuousBatchingKVCacheManager`, and the threaded lifecycle
  throughput of the Mojo manager with 1 and 8 Python threads (its calls drop the GIL;
  the Python manager is not thread-safe, so it runs single-threaded only).

Best of 3 runs each (the box is shared: the least disturbed run). The per-call numbers
use 1 KV head of 16 elements (the blocks' size does not enter the bookkeeping).
Usage: python benchmarks/bench_mojo_manager.py [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import mokv
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession
from mokv.mojo_package import _clean_env, _mojo_binary
from mokv.ops import kernels_path

MOJO_BENCH = Path(__file__).with_name("bench_mojo_manager.mojo")
SLOTS = 64


def from_mojo(repeats: int) -> dict[str, float]:
    """The Mojo benchmark's `name value` lines, best of `repeats` runs of one build."""
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "bench"
        subprocess.run([_mojo_binary(), "build", "-I", str(kernels_path().parent), str(MOJO_BENCH),
                        "-o", str(exe)], capture_output=True, env=_clean_env(), check=True, cwd=tmp)
        for _ in range(repeats):
            out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
            for k, v in (line.split() for line in out.splitlines() if line.strip()):
                pick = max if k.endswith("_per_s") else min
                best[k] = pick(best.get(k, float(v)), float(v))
    return best


def best_of(repeats: int, fn, *args) -> dict:
    """Per key: the lowest time (or highest rate) over `repeats` calls of `fn`."""
    runs = [fn(*args) for _ in range(repeats)]
    return {k: min(r[k] for r in runs) for k in runs[0]}


def per_call_ns(manager, reps: int) -> dict[str, float]:
    """ns per claim(1) / fetch / step / release, and per 32-sequence fetch + step."""
    t = dict.fromkeys(("claim", "fetch", "step", "release"), 0)
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        (sid,) = manager.claim(1)
        t1 = time.perf_counter_ns()
        manager.fetch([sid])
        t2 = time.perf_counter_ns()
        manager.step({sid: 1})
        t3 = time.perf_counter_ns()
        manager.release(sid)
        t4 = time.perf_counter_ns()
        for k, d in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            t[k] += d
    out = {k: v / reps for k, v in t.items()}
    ids = manager.claim(32)
    ones = dict.fromkeys(ids, 1)
    t0 = time.perf_counter_ns()
    for _ in range(reps // 10):
        manager.fetch(ids)
        manager.step(ones)
    out["fetch_step_batch32"] = (time.perf_counter_ns() - t0) / (reps // 10)
    for sid in ids:
        manager.release(sid)
    return out


def threaded_lifecycles_per_s(manager, threads: int, rounds: int) -> float:
    def work() -> None:
        for _ in range(rounds):
            try:
                (sid,) = manager.claim(1)
            except mokv.BatchTooLargeError:
                continue
            manager.fetch([sid])
            manager.step({sid: 1})
            manager.release(sid)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert manager.num_free_blocks == SLOTS
    return threads * rounds / (time.perf_counter() - t0)


def run(quick: bool = False) -> dict:
    reps = 2000 if quick else 20000
    repeats = 1 if quick else 3
    params = mokv.KVCacheParams(
        dtype=DType.float32,
        n_kv_heads=1,
        head_dim=16,
        cache_strategy=mokv.KVCacheStrategy.CONTINUOUS,
    )
    session = InferenceSession(devices=[CPU()])
    args = (params, SLOTS, reps // 10 + 8, 1, [CPU()], session)  # one token per batch step
    mojo_py = mokv.MojoContinuousBatchingKVCacheManager(*args)
    python = mokv.ContinuousBatchingKVCacheManager(*args)
    return {
        "mojo": from_mojo(repeats),
        "mojo_from_python": best_of(repeats, per_call_ns, mojo_py, reps),
        "python": best_of(repeats, per_call_ns, python, reps),
        "mojo_from_python_threads": {
            n: max(threaded_lifecycles_per_s(mojo_py, n, reps // (4 * n)) for _ in range(repeats))
            for n in (1, 8)
        },
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    r = run(parser.parse_args().quick)
    m = r["mojo"]
    print("| call (host ns) | Mojo from Mojo | Mojo from Python | Python manager |")
    print("| --- | --- | --- | --- |")
    for k in ("claim", "fetch", "step", "release", "fetch_step_batch32"):
        cells = (m[f"mojo_{k}_ns"], r["mojo_from_python"][k], r["python"][k])
        print(f"| {k} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    print(f"\nlifecycles/s (claim, fetch, step, release), 8 Mojo threads: "
          f"{m['mojo_threads_lifecycles_per_s']:.0f}")
    for n, v in r["mojo_from_python_threads"].items():
        print(f"lifecycles/s, {n} Python thread(s) on the Mojo manager: {v:.0f}")
