"""Runs the whole mokv benchmark suite and writes JSON, PNG plots and a markdown summary.

    python benchmarks/run.py [--quick] [--portable] [--out DIR]
                             [--parts hashing,events,managers,groups,attention,qkv,compile,serving,
                                      remote,cache_control,mla,fp8_tiers,recurrent,fp8_attention]

Parts (each module's docstring says what it measures and why):
  hashing    bench_hashing.py   prefix-hash throughput per algorithm, beside MAX's
  events     bench_events.py    hot-path cost of KV-cache events (trace replay on vs off)
  managers   bench_managers.py  scheduler trace replay (mokv, MAX 26.7 and, after `make
                                bench-vllm`, vLLM's v1 manager): host µs per request-step,
                                hit rate vs the infinite-cache bound, preemptions, memory,
                                at pages of 128 and 16 tokens; batch-size and page-budget
                                sweeps; agent sessions that pause (session turns' hit
                                rate: mokv sessions / LRU / vLLM vs the bound); mokv hot
                                spots
  groups     bench_groups.py    a sliding-window model's cache (Gemma-3-like, window 1024, 8k
                                contexts, shared prefixes): mokv with groups, without, and
                                MAX 26.7's hybrid (Jenga) manager on one trace and budget
  recurrent  bench_recurrent.py a hybrid linear-attention model's cache (Qwen3.5-like):
                                prefix hits with state checkpoints every page, every 4, none,
                                and MAX 26.7's own manager on one trace; checkpoint memory
  attention  bench_attention.py CPU ragged flash attention, mokv vs MAX, vs copy bandwidth
  qkv        bench_qkv.py       CPU QKV projection: mokv's fused_qkv_matmul vs MAX's matmul
  compile    bench_compile.py   cold and warm build+load of a graph with mokv's kernels
  serving    bench_serving.py   an agent trace over HTTP: `mokv serve` (plain, sessions,
                                host tier) beside `max serve`: TTFT, tokens/s, cached share
  remote     bench_remote.py    the shared tier on loopback: pages/s and GB/s stored and
                                loaded through one Redis and a Redis Cluster (its own
                                redis-servers), beside redis-py alone and a memory copy;
                                prefill saved by a warm restart on the agent trace
  cache_control  bench_cache_control.py  an agent pausing up to an hour beside a batch job
                                (fake clock): the agent's hit rate and TTFT with pins and
                                read-only writes vs LRU, sessions and MAX's manager
  mla        bench_mla.py       MLA caches: bytes per token and requests admitted against
                                GQA and MHA caches of a model of the same size; CPU MLA
                                decode attention's read bandwidth against the read probe
  fp8_tiers  bench_fp8_tiers.py the host and shared tiers' pages/s and bytes per page, FP8
                                pages (scaled and unscaled) against bfloat16, in one run
  fp8_attention  bench_fp8_attention.py  CPU decode attention over FP8 pages (with
                                scales) against bfloat16 and float32 pages, in one run;
                                MAX's CPU attention over an FP8 cache attempted, its refusal kept

--cpu-target NAME compiles every CPU kernel of the run, MAX's and mokv's, for the LLVM CPU NAME
(MAX's `max.driver.set_virtual_cpu_target`) and runs it on this host: `--cpu-target znver3` on an
AVX-512 machine times the AVX2 code (both sides) that an AMD Zen 3 host runs.

--portable adds, to attention, qkv and fp8_attention, mokv's kernels on the portable CPU
paths (the paths of a host without AVX-512, forced with `mokv.ops.portable_cpu_paths`),
timed beside the host's own paths and MAX's.

Results go to benchmarks/results/ (git-ignored): results.json, summary.md, *.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_attention  # noqa: E402
import bench_cache_control  # noqa: E402
import bench_compile  # noqa: E402
import bench_events  # noqa: E402
import bench_fp8_attention  # noqa: E402
import bench_fp8_tiers  # noqa: E402
import bench_groups  # noqa: E402
import bench_hashing  # noqa: E402
import bench_managers  # noqa: E402
import bench_mla  # noqa: E402
import bench_qkv  # noqa: E402
import bench_recurrent  # noqa: E402
import bench_remote  # noqa: E402
import bench_serving  # noqa: E402
import plots  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402

PARTS = ("hashing", "events", "managers", "groups", "attention", "qkv", "compile", "serving", "remote",
         "cache_control", "mla", "fp8_tiers", "recurrent", "fp8_attention")
SHARE = ("share of the two-thread read: median over seven rounds, each a probe read then "
         "the kernel's calls with the three sides taking turns, of kernel GB/s / probe GB/s")


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    info = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    get = lambda k: info.get(k, "?").strip()  # noqa: E731
    from importlib.metadata import version

    return {"cpu": get("Model name"), "cores": os.cpu_count(), "threads_per_core": get("Thread(s) per core"),
            "l2": get("L2 cache"), "l3": get("L3 cache"), "mem_GB": round(os.sysconf("SC_PAGE_SIZE") *
            os.sysconf("SC_PHYS_PAGES") / 1e9, 1), "python": platform.python_version(),
            "max": version("max"), "mojo": version("mojo"), "loadavg_start": os.getloadavg()}


def _plan(parts: list[str], quick: bool, portable: bool) -> int:
    s = bench_managers.settings(quick)
    sizes = {"hashing": 2, "events": 10 if quick else 20, "attention": bench_attention.plan_size(quick, portable),
             "qkv": len(bench_qkv.tokens(quick)),
             "compile": bench_compile.plan_size(quick), "serving": len(bench_serving.SERVERS),
             "groups": 3,
             "recurrent": len(bench_recurrent.RUNS),
             "remote": bench_remote.plan_size(quick),
             "cache_control": len(bench_cache_control.RUNS),
             "mla": len(bench_mla.cases(quick)),
             "fp8_tiers": bench_fp8_tiers.plan_size(quick),
             "fp8_attention": bench_fp8_attention.plan_size(quick, portable),
             "managers": 2 * len(bench_managers.MANAGERS) * s["repeats"] + len(s["batch_sizes"])
             + len(s["budgets"]) + 1 + 5}
    return sum(sizes[p] for p in parts)


def run(parts: list[str], quick: bool, out: Path, portable: bool = False) -> dict:
    from max.driver import get_virtual_cpu_target

    results: dict = {"machine": {**machine(), "cpu_target": get_virtual_cpu_target() or "host"},
                     "quick": quick, "portable": portable, "seconds": {}}
    previous = out / "results.json"
    if set(parts) != set(PARTS) and previous.is_file():  # a partial run updates the last one
        results = {**json.loads(previous.read_text()), **results, "seconds": {}}
    with Progress(TextColumn("{task.description:<34}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), transient=False) as bar:
        task = bar.add_task("starting", total=_plan(parts, quick, portable))
        tick = lambda: bar.advance(task)  # noqa: E731

        def part(name: str, desc: str, fn):
            bar.update(task, description=desc)
            t0 = time.perf_counter()
            try:
                value = fn()
            except Exception as e:  # noqa: BLE001 - one broken part must not lose the others
                value = {"error": f"{type(e).__name__}: {e}"[:2000]}
            results["seconds"][name] = round(time.perf_counter() - t0, 1)
            return value

        if "hashing" in parts:
            results["hashing"] = part("hashing", "prefix hashing", lambda: bench_hashing.run(quick, tick))
        if "events" in parts:
            results["events"] = part("events", "events on vs off (replay)",
                                     lambda: bench_events.run(quick, tick))
        if "managers" in parts:
            man = results["managers"] = {}
            man["compare"] = part("compare", "trace replay, pages of 128",
                                  lambda: bench_managers.compare(quick, tick))
            man["compare_page16"] = part("compare_page16", "trace replay, pages of 16",
                                         lambda: bench_managers.compare(quick, tick, 16))
            man["batch_sweep"] = part("batch_sweep", "decode batch-size sweep",
                                      lambda: bench_managers.batch_sweep(quick, tick))
            man["budget_sweep"] = part("budget_sweep", "page-budget sweep",
                                       lambda: bench_managers.budget_sweep(quick, tick))
            man["sessions"] = part("sessions", "agent sessions that pause",
                                   lambda: bench_managers.session_compare(quick, tick))
            man["mokv_profile"] = part("profile", "cProfile of mokv-paged",
                                       lambda: bench_managers.profile_mokv(quick))
            tick()
        # The parts that are one call each, in the order they run.
        single_parts = (
            ("groups", "sliding-window cache memory", lambda: bench_groups.run(quick, tick)),
            ("recurrent", "state checkpoints (hybrid cache)", lambda: bench_recurrent.run(quick, tick)),
            ("attention", "attention kernels (CPU)", lambda: bench_attention.run(quick, tick, portable)),
            ("qkv", "QKV projection (CPU)", lambda: bench_qkv.run(quick, tick, portable)),
            ("compile", "compile cost (subprocesses)", lambda: bench_compile.run(quick, tick)),
            ("serving", "agent trace over HTTP (servers)", lambda: bench_serving.run(quick, tick)),
            ("remote", "shared tier (redis-servers)", lambda: bench_remote.run(quick, tick)),
            ("cache_control", "pins and write policies", lambda: bench_cache_control.run(quick, tick)),
            ("mla", "MLA caches and decode (CPU)", lambda: bench_mla.run(quick, tick)),
            ("fp8_tiers", "FP8 pages in the tiers", lambda: bench_fp8_tiers.run(quick, tick)),
            ("fp8_attention", "FP8 pages' decode (CPU)", lambda: bench_fp8_attention.run(quick, tick, portable)),
        )
        for key, what, run_part in single_parts:
            if key in parts:
                results[key] = part(key, what, run_part)
        bar.update(task, description="done")
    results["machine"]["loadavg_end"] = os.getloadavg()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    results["plots"] = plots.write_all(results, out)
    (out / "summary.md").write_text(summary(results))
    return results


def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _replay_table(cmp: dict) -> list[str]:
    """The trace replay's table of one page size, and each manager's ratios to its peers."""
    if not cmp.get("managers"):
        return []
    vllm = cmp.get("vllm")
    lines = [f"### Trace replay ({cmp['trace']['requests']} requests, {cmp['budget_pages']} pages "
             f"of {cmp['page_size']}, batch ≤ {cmp['max_batch']}; infinite-cache bound "
             f"{cmp['infinite_cache_bound']:.3f})", ""]
    if vllm:
        lines += [
            f"vLLM {vllm['version']}, "
            f"prefix_caching_hash_algo={vllm['prefix_caching_hash_algo']!r}.",
            "",
        ]
    lines += [
        "| manager | µs/req-step median | p99 | bookkeeping med | runtime inputs med | hit rate | "
        "peak pages | preemptions | peak RSS growth MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in cmp["managers"].items():
        if "error" in s:
            lines.append(f"| {name} | error: {s['error'][-120:]!r} |")
            continue
        lines.append(
            f"| {name} | {_f(s['us_per_request_step']['median'], 2)} | "
            f"{_f(s['us_per_request_step']['p99'], 1)} | {_f(s['bookkeeping_us']['median'], 2)} | "
            f"{_f(s['runtime_inputs_us']['median'], 2)} | {s['hit_rate']:.3f} | "
            f"{s['peak_pages']} | "
            f"{s['preemptions']} | {s['peak_rss_growth_bytes'] / 1e6:.1f} |"
        )
    for peer in ("max", "vllm"):
        for name, ratio in cmp.get(f"ratio_vs_{peer}", {}).items():
            lines.append(f"\n{name} / {peer}-paged: all-in ×{ratio['us_per_request_step']}, bookkeeping "
                         f"×{ratio['bookkeeping_us']}, runtime inputs ×{ratio['runtime_inputs_us']}, "
                         f"hit rate ×{ratio['hit_rate']}")
    return lines + [""]


def _session_table(ses: dict) -> list[str]:
    """The agent-session replay: session turns' hit rate and tokens saved against the bound."""
    if not ses.get("runs"):
        return []
    bound, tokens = ses["session_turn_bound"], ses["session_turn_prompt_tokens"]
    lines = [f"### Agent sessions that pause ({ses['trace']['requests']} requests, "
             f"{ses['session_turns']} session turns of {tokens} prompt tokens; "
             f"{ses['budget_pages']} device pages of {ses['page_size']}, host tier "
             f"{ses['host_pages']} pages; session turns' infinite-cache bound {bound:.3f})", "",
             "| run | session-turn hit rate | of the bound | turn tokens saved | no-session hit "
             "rate | prefill tokens computed | preemptions |", "|---|---|---|---|---|---|---|"]
    rows = list(ses["runs"].items()) + [(f"mokv-sessions+host, max_share={k}", v)
                                        for k, v in ses["shares"].items()]
    for name, s in rows:
        lines.append(f"| {name} | {s['session_turn_hit_rate']:.3f} | "
                     f"{s['session_turn_hit_rate'] / bound:.1%} | {s['session_turn_tokens_saved']} | "
                     f"{s['no_session_hit_rate']:.3f} | {s['prefill_tokens_computed']} | "
                     f"{s['preemptions']} |")
    working_set = ses["runs"]["mokv-lru"]["session_working_set_pages"]
    return lines + ["", f"Sessions' peak working set: {working_set} pages.", ""]


def summary(r: dict) -> str:
    """Markdown tables of the headline numbers."""
    m = r["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_GB']} GB, MAX {m['max']}, "
        f"CPU kernels compiled for {m.get('cpu_target', 'host')}, "
        f"load average {m['loadavg_start'][0]:.2f} → {m['loadavg_end'][0]:.2f}",
        "",
    ]
    for key in ("compare", "compare_page16"):
        lines += _replay_table(r.get("managers", {}).get(key, {}))
    lines += _session_table(r.get("managers", {}).get("sessions", {}))
    if r.get("groups", {}).get("managers"):
        lines += bench_groups.table(r["groups"])
    if r.get("recurrent", {}).get("managers"):
        lines += bench_recurrent.table(r["recurrent"])
    if r.get("serving", {}).get("servers"):
        lines += bench_serving.table(r["serving"])
    if r.get("remote", {}).get("layouts"):
        lines += bench_remote.table(r["remote"])
    if r.get("fp8_tiers", {}).get("formats"):
        lines += bench_fp8_tiers.table(r["fp8_tiers"])
    if r.get("cache_control", {}).get("runs"):
        lines += bench_cache_control.table(r["cache_control"])
    if r.get("mla", {}).get("sizing"):
        lines += bench_mla.table(r["mla"])
    if r.get("fp8_attention", {}).get("decode"):
        lines += bench_fp8_attention.table(r["fp8_attention"])
    sweep = r.get("managers", {}).get("batch_sweep", {})
    if isinstance(sweep, dict) and "error" not in sweep and sweep:
        names = list(sweep)
        lines += ["### Steady decode, µs per request-step (all-in / bookkeeping)", "",
                  "| batch | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for b in sweep[names[0]]:
            cells = [
                f"{_f(sweep[n][b]['us_per_request_step'], 2)} / "
                f"{_f(sweep[n][b]['bookkeeping_us'], 2)}"
                for n in names
            ]
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines.append("")
    h = r.get("hashing", {})
    if h.get("mokv"):
        lines += ["### Prefix hashing (M tokens/s)", "", "| algorithm | tokens/s |", "|---|---|"]
        lines += [f"| mokv {k} | {v / 1e6:.1f} M |" for k, v in h["mokv"].items()]
        lines += [f"| MAX {k} (reference) | {v / 1e6:.1f} M |" for k, v in h.get("max", {}).items()]
        lines.append("")
    ev = r.get("events", {})
    if ev.get("on"):
        d = ev["direct"]
        lines += ["### KV-cache events: host µs per request-step, trace replay", "",
                  "| events | median (least disturbed repeat) | mean |", "|---|---|---|",
                  f"| off | {_f(ev['off']['median_us'], 2)} | {_f(ev['off']['mean_us'], 2)} |",
                  f"| on | {_f(ev['on']['median_us'], 2)} | {_f(ev['on']['mean_us'], 2)} |", "",
                  f"Difference: {ev['delta_median_us']:+.2f} (least disturbed), "
                  f"{ev['delta_paired_median_us']:+.2f} (median of paired repeats); the "
                  f"scheduling thread's own added work: {d['us_per_request_step']:.3f} "
                  f"µs per request-step ({d['calls']}).", ""]
    a = r.get("attention", {})
    if a.get("decode"):
        sides = list(a["sides"])
        c = a["copy"]
        floor = f", MAX's execute floor {a['execute_floor_us']:.0f} µs" if "execute_floor_us" in a else ""
        lines += [f"### CPU attention (copy {c['numpy_copy_GBps']:.1f} GB/s, two-thread read "
                  f"{c['read_2threads_GBps']:.1f} GB/s{floor})", "",
                  f"Decode cells: ms (GB/s of K/V read, {SHARE}).", "",
                  "| decode B × ctx | " + " | ".join(f"{s} ms (GB/s, share)" for s in sides) + " |",
                  "|---" * (len(sides) + 1) + "|"]
        for row in a["decode"]:
            cells = [f"{row[s]['ms']:.2f} ({row[s]['GBps']:.1f}, {row[s]['share_of_read']:.0%})" if s in row
                     else "-" for s in sides]
            lines.append(f"| {row['batch']} × {row['context']} | " + " | ".join(cells) + " |")
        for row in a["prefill"]:
            cells = [f"{row[s]['ms']:.1f} ({row[s]['GFLOPs']:.0f} GFLOP/s)" if s in row else "-" for s in sides]
            lines.append(f"| prefill {row['tokens']} | " + " | ".join(cells) + " |")
        for name, err in a.get("errors", {}).items():
            lines.append(f"\n{name} skipped: {err[:300]}")
        lines.append("")
    if a.get("shapes"):
        sides = [s for s in ("max-paged", "mokv-paged", "mokv-continuous", "mokv-paged-portable")
                 if any(s in row for row in a["shapes"])]
        lines += ["### CPU decode attention by GQA group and dtype (32 query heads, head_dim 128)", "",
                  f"Cells: ms (GB/s of K/V read, {SHARE}).", "",
                  "| group (kv heads) | dtype | B × ctx | " + " | ".join(sides) + " | MAX / mokv-paged time |",
                  "|---" * (len(sides) + 4) + "|"]
        for row in a["shapes"]:
            cells = [f"{row[s]['ms']:.2f} ({row[s]['GBps']:.1f}, {row[s]['share_of_read']:.0%})" if s in row
                     else "-" for s in sides]
            ratio = (f"×{row['max-paged']['ms'] / row['mokv-paged']['ms']:.1f}"
                     if "max-paged" in row and "mokv-paged" in row else "-")
            if "mokv-paged-portable" in row and "max-paged" in row:
                ratio += (
                    f" (portable ×{row['max-paged']['ms'] / row['mokv-paged-portable']['ms']:.1f})"
                )
            lines.append(
                f"| {row['group']} ({row['n_kv_heads']}) | {row['dtype']} | "
                f"{row['batch']} × {row['context']} | " + " | ".join(cells) + f" | {ratio} |"
            )
        errs = {k: v for row in a["shapes"] for k, v in row.get("errors", {}).items()}
        for name, err in errs.items():
            lines.append(f"\n{name} skipped for some shapes: {err[:300]}")
        lines.append("")
    qkv = r.get("qkv", {})
    if qkv.get("rows"):
        sh = qkv["shape"]
        sides = [
            s
            for s in ("max-matmul", "mokv-fused_qkv", "mokv-fused_qkv-portable")
            if s in qkv["rows"][0]
        ]
        lines += [
            f"### CPU QKV projection (hidden {sh['hidden']} → {sh['n_heads']} q + "
            f"2 × {sh['n_kv_heads']} kv "
            f"heads of {sh['head_dim']}, {sh['dtype']})",
            "",
            "| tokens | " + " | ".join(f"{s} ms (GFLOP/s)" for s in sides) + " | MAX / mokv time |",
            "|---" * (len(sides) + 2) + "|",
        ]
        for row in qkv["rows"]:
            cells = [f"{row[s]['ms']:.2f} ({row[s]['GFLOPs']:.0f})" for s in sides]
            ratio = " / ".join(f"×{row['max-matmul']['ms'] / row[s]['ms']:.2f}" for s in sides[1:])
            lines.append(f"| {row['tokens']} | " + " | ".join(cells) + f" | {ratio} |")
        lines.append("")
    comp = r.get("compile", {})
    if comp and "error" not in comp:
        lines += ["### Compile (s)", "", "| run | kernels | graph build | build + load | first step | subprocess total |",
                  "|---|---|---|---|---|---|"]
        for name, c in comp.items():
            lines.append(f"| {name} | " + " | ".join(_f(c.get(k), 2) for k in
                         ("kernels_s", "build_s", "build_and_load_s", "first_step_s", "total_s")) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller traces and grids (~1-2 min warm)")
    ap.add_argument("--portable", action="store_true",
                    help="attention and qkv: also time mokv on the portable CPU paths")
    ap.add_argument("--cpu-target", default="", metavar="NAME",
                    help="compile every CPU kernel (MAX's and mokv's) for this LLVM CPU, e.g. znver3 "
                         "(AVX2, no AVX-512), and run it here")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS))
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    bad = set(parts) - set(PARTS)
    if bad:
        ap.error(f"unknown parts {sorted(bad)}")
    if args.cpu_target:
        from max.driver import set_virtual_cpu_target

        set_virtual_cpu_target(args.cpu_target)  # before anything compiles
    results = run(parts, args.quick, args.out, args.portable)
    Console().print(summary(results))
    print(f"wrote {args.out}/results.json, summary.md, {', '.join(results['plots'])}")
    sys.stdout.flush()
    os._exit(0)  # MAX's runtime threads can delay interpreter exit


if __name__ == "__main__":
    main()
