"""Hot-path cost of KV-cache events: the trace replay with events off and on.

The same trace (`bench_managers`' main trace and page budget) runs through mokv's paged
manager twice per repeat, events off then on (interleaved, so a burst of other load
hits both), in this process. With events on, the manager publishes to an inproc PUB
socket with a replay buffer; nothing subscribes, so ZMQ drops the messages after the
publisher thread has built and encoded them (that thread's work competes for the GIL,
which the timings include). Reported: host µs per request-step (median over steps and
mean) of the least disturbed repeat of each, their difference, and the median over
repeats of the paired difference (on minus the off run just before it). Budget: +0.5 µs.
On a shared machine those differences are within the noise, so `direct` also reports
the scheduling thread's own added work: sink and `end_step` calls counted over a replay,
each call's cost timed alone, per request-step (this leaves out GIL contention with
the publisher thread, which the replay differences include).
"""

from __future__ import annotations

import gc
import itertools
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# The benchmarks' own modules, found through sys.path above.
from bench_managers import MAX_SEQ_LEN, PAGE_SIZE, settings  # noqa: E402
from managers import MokvPaged  # noqa: E402
from mokv.events import KVEventsConfig  # noqa: E402
from replay import replay  # noqa: E402
from serving_trace import TraceConfig, make_trace  # noqa: E402

_names = itertools.count()


def _one(trace, s, events: bool) -> dict:
    config = None
    if events:
        name = f"inproc://bench-events-{next(_names)}"
        config = KVEventsConfig(name, replay_endpoint=name + "-replay")
    adapter = MokvPaged(s["budget"], s["max_batch"], MAX_SEQ_LEN, page_size=PAGE_SIZE,
                        kv_events_config=config)
    gc.collect()
    gc.freeze()
    out = replay(adapter, trace).summary()
    gc.unfreeze()
    pubs = adapter.manager.kv_event_publishers
    adapter.manager.close()
    if pubs:
        out["batches"] = sum(p.num_published for p in pubs)
        out["dropped"] = sum(p.num_dropped for p in pubs)
    return out


def _direct_cost(trace, s) -> dict:
    """The scheduling thread's own added work, without the noise of whole replays: how
    often the replay calls the sink and `end_step` (counted in an untimed run), times
    what one call costs (timed alone, best of 5), per request-step."""
    counts = {"stored": 0, "removed": 0, "cleared": 0, "end_step": 0}
    name = f"inproc://bench-events-{next(_names)}"
    adapter = MokvPaged(s["budget"], s["max_batch"], MAX_SEQ_LEN, page_size=PAGE_SIZE,
                        kv_events_config=KVEventsConfig(name))
    pub = adapter.manager.kv_event_publishers[0]
    def counting(method: str):
        call = getattr(pub, method)

        def counted(*args):
            counts[method] += 1
            return call(*args)

        return counted

    for method in counts:
        setattr(pub, method, counting(method))
    steps = replay(adapter, trace).summary()["request_steps"]
    adapter.manager.close()
    data, n = bytes(8 * PAGE_SIZE), 20_000
    probe = MokvPaged(s["budget"], s["max_batch"], MAX_SEQ_LEN, page_size=PAGE_SIZE,
                      kv_events_config=KVEventsConfig(f"inproc://bench-events-{next(_names)}"))
    p = probe.manager.kv_event_publishers[0]
    calls = {"stored": lambda: p.stored(12345, 678, data, None), "removed": lambda: p.removed(1),
             "cleared": p.cleared, "end_step": lambda: (p.removed(1), p.end_step())}
    per_call = {}
    for method, call in calls.items():
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            best = min(best, (time.perf_counter() - t0) / n)
            p._pending.clear()
        per_call[method] = best * 1e6
    per_call["end_step"] -= per_call["removed"]
    probe.manager.close()
    total = sum(counts[m] * per_call[m] for m in counts)
    return {"calls": counts, "us_per_call": {k: round(v, 3) for k, v in per_call.items()},
            "request_steps": steps, "us_per_request_step": round(total / steps, 4)}


def run(quick: bool = False, progress=None) -> dict:
    s = settings(quick)
    repeats = 10 if quick else 20  # a replay takes well under a second: repeat a lot,
    trace = make_trace(TraceConfig(num_sessions=s["sessions"]))  # the machine is shared
    _one(trace[:20], s, True)  # warm up imports and sockets
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(repeats):
        for key in ("off", "on"):
            runs[key].append(_one(trace, s, key == "on"))
        if progress:
            progress()
    out: dict = {}
    for key, rs in runs.items():
        best = min(rs, key=lambda r: r["us_per_request_step"]["median"])
        out[key] = {"median_us": best["us_per_request_step"]["median"],
                    "mean_us": best["us_per_request_step"]["mean"],
                    "repeat_medians_us": [r["us_per_request_step"]["median"] for r in rs],
                    "request_steps": best["request_steps"]}
        for k in ("batches", "dropped"):
            if k in best:
                out[key][k] = best[k]
    out["delta_median_us"] = round(out["on"]["median_us"] - out["off"]["median_us"], 3)
    # Paired: each repeat's on minus the off run just before it, the median over repeats.
    pairs = sorted(on["us_per_request_step"]["median"] - off["us_per_request_step"]["median"]
                   for off, on in zip(runs["off"], runs["on"]))
    out["delta_paired_median_us"] = round(pairs[len(pairs) // 2], 3)
    out["delta_mean_us"] = round(out["on"]["mean_us"] - out["off"]["mean_us"], 3)
    out["direct"] = _direct_cost(trace, s)
    return out


if __name__ == "__main__":
    import json
    import os

    print(json.dumps(run("--quick" in sys.argv), indent=1))
    sys.stdout.flush()
    os._exit(0)
