"""Host cost and prefix-cache benefit of the KV cache managers, replaying one trace.

Four measurements, all through `replay.replay` (no model execution):

- `compare`: the main trace at a tight page budget (preemption happens), each manager
  in a fresh subprocess so its peak RSS growth is its own; `repeats` replays each,
  interleaved across managers, and the least disturbed one (lowest median) reported.
  Per manager: host µs per scheduled request-step (median
  and p99 over steps, split into bookkeeping and runtime-input building), the prefix
  hit rate the harness saw against the infinite-cache bound, peak pages, preemptions.
- `batch_sweep`: steady decode of B requests (1k-token prompts, 64 new tokens): the
  per-step cost as a function of batch size, where fixed per-step costs show.
- `budget_sweep`: hit rate against the page budget on a smaller trace.
- `session_compare`: the main trace with agent sessions that pause for tool calls
  (`trace.add_agent_sessions`): the hit rate of a session's next turn and the prefill
  tokens it saved, mokv with sessions vs mokv's plain LRU vs vLLM's manager, against the
  trace's infinite-cache bound on those turns, with and without a host tier sized so that
  the sessions' working set fits in device + host pages; and mokv's sessions at four
  shares of the pool (`SessionConfig.max_share`).

The managers: mokv's paged manager (with and without its lock), mokv's continuous
manager, MAX 26.7's paged manager and, where `make bench-vllm` installed it, vLLM's v1
`KVCacheManager` (`vllm_peer.py`), all behind the same scheduler on the same trace.
`compare` runs at pages of 128 tokens (`PAGE_SIZE`) and, for vLLM's GPU default, 16.

`profile_mokv` runs cProfile over mokv's replay to name its hot spots.
"""

from __future__ import annotations

import cProfile
import dataclasses
import functools
import gc
import importlib.util
import json
import os
import pstats
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serving_trace import (  # noqa: E402
    Request,
    TraceConfig,
    infinite_cache_bound,
    infinite_cache_hits,
    make_trace,
    summarize,
)

MANAGERS = ("mokv-paged", "mokv-paged-nolock", "mokv-continuous", "max-paged") + (
    ("vllm-paged",) if importlib.util.find_spec("vllm") is not None else ())
MAX_SEQ_LEN = 16384
PAGE_SIZE = 128
BUDGET_TOKENS = 300 * 128  # the main trace's page budget, in tokens (300 pages of 128)


def settings(quick: bool) -> dict:
    return dict(sessions=150 if quick else 400, agent_sessions=8 if quick else 16,
                budget=BUDGET_TOKENS // PAGE_SIZE, max_batch=64,
                repeats=2 if quick else 5, sweep_sessions=80 if quick else 200,
                budgets=[160, 300, 600, 1200] if quick else [160, 220, 300, 450, 600, 900, 1200, 2400],
                batch_sizes=[1, 4, 16, 64] if quick else [1, 2, 4, 8, 16, 32, 64, 128])


def child_env() -> dict:
    """os.environ as Python saw it, without what native MAX/Mojo code set at the C level.

    After MAX's Rust/Mojo extensions load, the process environment carries
    PYTHONEXECUTABLE (the pyenv shim) and PYTHONPATH=":", which would start a child
    outside the virtualenv; `os.environ` does not see those, so pass it explicitly. A
    PYTHONPATH the caller set (a checkout's `python/` timed against the installed mokv)
    is kept: dropping it timed the installed package in every replay.
    """
    drop = ("PYTHONEXECUTABLE", "MOJO_PYTHON_LIBRARY")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if not env.get("PYTHONPATH", "").strip(os.pathsep):
        env.pop("PYTHONPATH", None)
    return env


def _kib(field: str) -> int:
    found = re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())
    assert found is not None, f"/proc/self/status has no {field}"
    return int(found.group(1))


def _one(manager: str, trace: list[Request], budget: int, max_batch: int,
         page_size: int = PAGE_SIZE, **kw) -> dict:
    from managers import ADAPTERS
    from replay import replay

    adapter = ADAPTERS[manager](budget, max_batch, MAX_SEQ_LEN, page_size=page_size)
    gc.collect()
    gc.freeze()
    out = replay(adapter, trace, **kw).summary()
    out["kv_pool_bytes"] = adapter.kv_bytes
    out["total_pages"] = adapter.total_pages
    gc.unfreeze()
    return out


def worker(spec: dict) -> dict:
    """Body of one subprocess of `compare`: one replay of one manager, peak RSS measured."""
    trace = make_trace(TraceConfig(num_sessions=spec["sessions"]))
    page_size = spec.get("page_size", PAGE_SIZE)
    _one(spec["manager"], trace[:20], spec["budget"], spec["max_batch"], page_size)  # imports
    gc.collect()
    rss0 = _kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (Linux)
    run = _one(spec["manager"], trace, spec["budget"], spec["max_batch"], page_size)
    run["peak_rss_growth_bytes"] = (_kib("VmHWM") - rss0) * 1024
    return run


def _best(runs: list[dict]) -> dict:
    """The repeat with the lowest median cost (the one least disturbed by other load)."""
    best = dict(min(runs, key=lambda r: r["us_per_request_step"]["median"]))
    best["repeat_medians_us"] = [r["us_per_request_step"]["median"] for r in runs]
    return best


COMPARED = ("mokv-paged", "mokv-continuous")
"""The managers `compare` sets against each peer (MAX's, vLLM's) in its ratios."""


def compare(quick: bool, progress=None, page_size: int = PAGE_SIZE) -> dict:
    """The main trace through every manager at `page_size` tokens a page, under the same
    memory (`BUDGET_TOKENS`), each replay in its own subprocess, repeats interleaved."""
    s = settings(quick)
    budget = BUDGET_TOKENS // page_size
    trace = make_trace(TraceConfig(num_sessions=s["sessions"]))
    out = {"trace": summarize(trace), "budget_pages": budget, "max_batch": s["max_batch"],
           "page_size": page_size, "max_seq_len": MAX_SEQ_LEN,
           "infinite_cache_bound": infinite_cache_bound(trace, page_size), "managers": {}}
    if "vllm-paged" in MANAGERS:
        from vllm_peer import HASH_ALGO, version

        out["vllm"] = {"version": version(), "prefix_caching_hash_algo": HASH_ALGO}
    runs: dict[str, list[dict]] = {m: [] for m in MANAGERS}
    for _ in range(s["repeats"]):  # interleaved, so a burst of other load hits every manager
        for m in MANAGERS:
            spec = dict(manager=m, sessions=s["sessions"], budget=budget,
                        max_batch=s["max_batch"], page_size=page_size)
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                  capture_output=True, text=True, cwd=HERE, env=child_env())
            if proc.returncode:
                out["managers"][m] = {"error": proc.stderr[-2000:]}
            else:
                runs[m].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            if progress:
                progress()
    for m, rs in runs.items():
        if rs:
            out["managers"][m] = _best(rs)
    for peer in ("max-paged", "vllm-paged"):
        ratios = _ratios(out["managers"], peer)
        if ratios:
            out[f"ratio_vs_{peer.split('-')[0]}"] = ratios
    return out


def _ratios(ms: dict, peer: str) -> dict:
    """Each of `COMPARED` over `peer`: medians of the three timings, and the hit rates."""
    if "error" in ms.get(peer, {"error": 1}):
        return {}
    out = {}
    for m in COMPARED:
        if "error" in ms.get(m, {"error": 1}):
            continue
        ratio = {key: round(ms[m][key]["median"] / ms[peer][key]["median"], 3)
                 for key in ("us_per_request_step", "bookkeeping_us", "runtime_inputs_us")}
        ratio["hit_rate"] = round(ms[m]["hit_rate"] / max(ms[peer]["hit_rate"], 1e-9), 3)
        out[m] = ratio
    return out


def batch_sweep(quick: bool, progress=None) -> dict:
    s, rng = settings(quick), np.random.default_rng(1)
    out: dict = {m: {} for m in MANAGERS}
    for b in s["batch_sizes"]:
        trace = [Request(i, "decode", rng.integers(0, 50_000, 1000), 65, i + 1, 0)
                 for i in range(b)]
        pages = b * (MAX_SEQ_LEN // PAGE_SIZE + 2)  # room for b continuous slots too
        runs: dict[str, list[dict]] = {m: [] for m in MANAGERS}
        for _ in range(s["repeats"]):
            for m in MANAGERS:
                runs[m].append(_one(m, trace, pages, b, token_budget=1 << 30))
        for m in MANAGERS:
            best = _best(runs[m])
            out[m][b] = {k: best[k]["median"]
                         for k in ("us_per_request_step", "bookkeeping_us", "runtime_inputs_us")}
        if progress:
            progress()
    return out


def budget_sweep(quick: bool, progress=None) -> dict:
    s = settings(quick)
    trace = make_trace(TraceConfig(num_sessions=s["sweep_sessions"], seed=1))
    out = {"bound": infinite_cache_bound(trace, PAGE_SIZE), "budgets": s["budgets"],
           "managers": {m: [] for m in MANAGERS}}
    for budget in s["budgets"]:
        for m in MANAGERS:
            r = _one(m, trace, budget, s["max_batch"])
            out["managers"][m].append({k: r[k] for k in ("hit_rate", "preemptions", "peak_pages",
                                                         "prefill_tokens_computed")})
        if progress:
            progress()
    return out


SESSION_SHARES = (0.25, 0.5, 0.75, 1.0)
SESSION_KEYS = ("session_turn_hit_rate", "session_turn_tokens_saved", "no_session_hit_rate",
                "hit_rate", "prefill_tokens_computed", "preemptions", "session_working_set_pages")


def _session_run(name: str, trace: list[Request], budget: int, max_batch: int, host_pages: int,
                 share: float | None) -> dict:
    """One replay of the agent trace; mokv with `host_pages` host pages (0: none) and
    sessions at `share` (None: plain LRU), or vLLM's manager (device pages only)."""
    import mokv
    from managers import ADAPTERS, SHAPE
    from replay import replay

    kw: dict = {}
    if name.startswith("mokv"):
        if host_pages:
            page_bytes = mokv.KVCacheParams(
                mokv.config.base.CACHE_DTYPES[0],
                SHAPE["n_kv_heads"],
                SHAPE["head_dim"],
                page_size=PAGE_SIZE,
            ).bytes_per_page(SHAPE["num_layers"])
            kw["tiers"] = (mokv.HostTierConfig(swap_space_gb=host_pages * page_bytes / 2**30),)
        if share is not None:
            kw["sessions"] = mokv.SessionConfig(max_share=share)
    adapter = ADAPTERS["vllm-paged" if name == "vllm" else "mokv-paged"](
        budget, max_batch, MAX_SEQ_LEN, page_size=PAGE_SIZE, **kw)
    summary = replay(adapter, trace, page_size=PAGE_SIZE).summary()
    out = {k: summary[k] for k in SESSION_KEYS}
    if share is not None:
        out["sessions"] = dataclasses.asdict(adapter.manager.metrics.sessions)
    return out


def session_compare(quick: bool, progress=None) -> dict:
    """Agent sessions that pause, side by side in one run (see the module docstring).

    The host tier holds the pages that, with the device's, hold the sessions' peak
    working set plus 10 % (measured by a first replay, rounded up to 100 pages), so the
    sessions fit in device + host pages while the rest of the traffic cycles both.
    """
    s = settings(quick)
    budget = BUDGET_TOKENS // PAGE_SIZE
    trace = make_trace(TraceConfig(num_sessions=s["sessions"], agent_sessions=s["agent_sessions"]))
    hits = infinite_cache_hits(trace, PAGE_SIZE)
    turns = [i for i, r in enumerate(trace) if r.session is not None and r.parent is not None]
    bound = sum(hits[i] for i in turns) / sum(len(trace[i].prompt) for i in turns)
    run = functools.partial(_session_run, trace=trace, budget=budget, max_batch=s["max_batch"])
    lru = run("mokv-lru", host_pages=0, share=None)
    working_set = lru["session_working_set_pages"]
    host = -(-max(int(1.1 * working_set) - budget, 0) // 100) * 100
    out: dict = {
        "trace": summarize(trace),
        "budget_pages": budget,
        "page_size": PAGE_SIZE,
        "host_pages": host,
        "session_turns": len(turns),
        "session_turn_prompt_tokens": sum(len(trace[i].prompt) for i in turns),
        "session_turn_bound": bound,
        "session_turn_tokens_bound": sum(hits[i] for i in turns),
        "runs": {},
        "shares": {},
    }
    rows = [
        ("mokv-sessions+host", host, mokv_default_share()),
        ("mokv-lru+host", host, None),
        ("mokv-sessions", 0, mokv_default_share()),
        ("mokv-lru", 0, None),
    ]
    if "vllm-paged" in MANAGERS:
        rows.append(("vllm", 0, None))
    for name, host_pages, share in rows:
        out["runs"][name] = lru if name == "mokv-lru" else run(name, host_pages=host_pages,
                                                               share=share)
        if progress:
            progress()
    for share in SESSION_SHARES:
        out["shares"][share] = run("mokv-sessions+host", host_pages=host, share=share)
    return out


def mokv_default_share() -> float:
    from mokv.config.sessions import DEFAULT_MAX_SHARE

    return DEFAULT_MAX_SHARE


def profile_mokv(quick: bool, top: int = 15) -> list[dict]:
    """cProfile of mokv-paged over the main trace: the `top` functions by own time."""
    s = settings(quick)
    trace = make_trace(TraceConfig(num_sessions=s["sessions"]))
    prof = cProfile.Profile()
    prof.runcall(_one, "mokv-paged", trace, s["budget"], s["max_batch"])
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]  # the raw table
    rows = []
    for (file, line, fn), (_, calls, tottime, cumtime, _) in stats.items():
        if "mokv" in file and "benchmarks" not in file:
            rows.append({"function": f"{Path(file).name}:{line}({fn})", "calls": calls,
                         "tottime_s": round(tottime, 4), "cumtime_s": round(cumtime, 4)})
    rows.sort(key=lambda r: -r["tottime_s"])
    return rows[:top]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))))
    elif "--sessions" in sys.argv:
        print(json.dumps(session_compare("--quick" in sys.argv), indent=1))
        os._exit(0)
    else:
        quick = "--quick" in sys.argv
        print(json.dumps({"compare": compare(quick), "batch_sweep": batch_sweep(quick)}, indent=1))
        os._exit(0)
