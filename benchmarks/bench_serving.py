"""Serving: a multi-turn agent trace over HTTP, `mokv serve` beside `max serve`, in one run.

Every server serves MAX's tiny random-weight Llama (`mokv_graphs.TINY_LLAMA`, float32, on
the CPU) with the same `max serve` flags; only the KV cache differs. The trace: agents
that share a system prompt; each turn sends the whole conversation so far (system
prompt, earlier turns, a new tool result) as token ids, streams a greedy reply, then
pauses for a tool call before its next turn. Several agents run at once, more than the
batch holds, and their contexts together outgrow the device pages, so what a paused
agent finds cached when it comes back is what the cache kept for it.

Per server: TTFT p50 / p99 (first streamed token), output tokens per second over the
run, and the share of prompt tokens served from cache (`usage.cached_tokens`). mokv runs
four ways: plain, with sessions (`dkv_cache_hint` names the agent's session), with a
host tier, with both. Every turn's greedy reply is kept, and each server's replies are
compared with `max serve`'s: the same tokens turn by turn until the first that differs
(a different reply changes every later prompt of that agent).

On a GPU (`--gpu`) the checkpoint is bfloat16 and the servers run with MAX's defaults
there (device graph capture and the overlap scheduler as MAX sets them), `max serve`
beside `mokv serve`:

    python benchmarks/bench_serving.py [--quick] [--gpu] [--json PATH]
"""

from __future__ import annotations

import json
import re
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

SERVE_ARGS = [
    "--devices", "cpu", "--quantization-encoding", "float32", "--max-length", "1024",
    "--max-batch-size", "2", "--enable-prefix-caching",
]
GPU_SERVE_ARGS = ["--devices", "gpu", "--quantization-encoding", "bfloat16", "--max-length", "1024",
                  "--enable-prefix-caching", "--device-memory-utilization", "0.3"]
"""On a GPU: MAX's defaults but for the memory (0.3 of it leaves room for the GPU tests
the same machine runs beside the servers)."""
GPU_SERVERS = ("max serve", "mokv serve")
SERVERS = {
    "max serve": ("max", None),
    "mokv serve": ("mokv", {}),
    "mokv serve + sessions": ("mokv", {"sessions": {"ttl_s": 600}}),
    "mokv serve + host tier": ("mokv", {"host_tier": {"swap_space_gb": 0.05}}),
    "mokv serve + both": ("mokv", {"sessions": {"ttl_s": 600},
                                   "host_tier": {"swap_space_gb": 0.05}}),
}
REPLY_TOKENS = 16
WORD = re.compile(r"t(\d+)")


def trace(quick: bool) -> dict:
    """The agents' prompts and pauses, the same for every server (seeded)."""
    rng = np.random.default_rng(0)
    users, turns = (3, 3) if quick else (8, 5)
    system = rng.integers(3, 256, 256).tolist()
    return {
        "system": system,
        "agents": [
            {
                "task": rng.integers(3, 256, 64).tolist(),
                "tools": [rng.integers(3, 256, int(rng.integers(64, 128))).tolist()
                          for _ in range(turns)],
                "pauses": rng.uniform(0.5, 2.5, turns).round(2).tolist(),
                "start": float(rng.uniform(0, 1.5)),
            }
            for _ in range(users)
        ],
    }


def _agent(client, model: str, system: list[int], agent: dict, session: str, out: list) -> None:
    """One agent's turns, one streamed request each; appends a record per turn to `out`."""
    time.sleep(agent["start"])
    conversation = system + agent["task"]
    for tool, pause in zip(agent["tools"], agent["pauses"]):
        conversation = conversation + tool
        t0 = time.perf_counter()
        first = None
        text, usage = "", None
        stream = client.completions.create(
            model=model, prompt=conversation, max_tokens=REPLY_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"dkv_cache_hint": {"session_id": session}},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter()
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage
        reply = [int(t) for t in WORD.findall(text)]
        assert usage is not None, "the stream ended without its usage chunk"
        out.append({
            "ttft_s": (first or time.perf_counter()) - t0,
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens or 0,
            "output_tokens": usage.completion_tokens,
            "agent": session,
            "reply": reply,
        })
        conversation = conversation + reply
        time.sleep(pause)


def serve_trace(server, tr: dict) -> dict:
    """Runs every agent of the trace at once against one server; the run's figures."""
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=600)
    model = server.command[server.command.index("--model") + 1]
    # One request first, outside the figures: a server's first batch pays one-time costs.
    client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=2)
    records: list = []
    t0 = time.perf_counter()
    threads = [
        threading.Thread(target=_agent, args=(client, model, tr["system"], a, f"agent-{i}", records))
        for i, a in enumerate(tr["agents"])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = np.array([r["ttft_s"] for r in records]) * 1e3
    prompt = sum(r["prompt_tokens"] for r in records)
    return {
        "requests": len(records),
        "ttft_ms": {"p50": round(float(np.percentile(ttft, 50)), 1),
                    "p99": round(float(np.percentile(ttft, 99)), 1)},
        "output_tokens_per_s": round(sum(r["output_tokens"] for r in records) / wall, 2),
        "cached_share": round(sum(r["cached_tokens"] for r in records) / prompt, 4),
        "prompt_tokens": prompt,
        "wall_s": round(wall, 1),
        "replies": _replies(records),
    }


def _replies(records: list) -> dict:
    """Each agent's replies in turn order (an agent's turns run one after another)."""
    out: dict = {}
    for r in records:
        out.setdefault(r["agent"], []).append(r["reply"])
    return out


def same_replies(replies: dict, reference: dict) -> tuple[int, int]:
    """(turns whose reply equals the reference's, turns) over the agents' turns in order;
    an agent's turns after its first different reply count as different."""
    same = total = 0
    for agent, theirs in reference.items():
        mine = replies.get(agent, [])
        total += len(theirs)
        for a, b in zip(mine, theirs):
            if a != b:
                break
            same += 1
    return same, total


def run(quick: bool, tick=lambda: None, gpu: bool = False) -> dict:
    """The trace against every server in SERVERS (GPU_SERVERS with `gpu`), one at a time
    (each owns the machine)."""
    import mokv_graphs as mg
    from mokv.pipelines.server_process import ServerProcess

    work = Path(tempfile.mkdtemp(prefix="mokv-bench-serving-"))
    if gpu:
        weights = mg.init_weights(mg.TINY_LLAMA, seed=0)
        model = mg.save_checkpoint(work / "tiny-llama-bf16", mg.TINY_LLAMA, weights, dtype="bfloat16")
    else:
        model = mg.tiny_llama_checkpoint(work / "tiny-llama")
    serve_args = GPU_SERVE_ARGS if gpu else SERVE_ARGS
    servers = {n: SERVERS[n] for n in GPU_SERVERS} if gpu else SERVERS
    tr = trace(quick)
    results: dict = {"servers": {}, "agents": len(tr["agents"]),
                     "turns": len(tr["agents"][0]["tools"]), "serve_args": serve_args}
    for name, (program, config) in servers.items():
        args = ["--model", str(model), *serve_args]
        if config:
            path = work / f"{len(results['servers'])}.yaml"
            path.write_text(json.dumps(config))
            args += ["--mokv-config", str(path)]
        log = work / f"{len(results['servers'])}.log"
        try:
            with ServerProcess(program, args, log) as server:
                results["servers"][name] = serve_trace(server, tr)
        except Exception as e:  # noqa: BLE001 - one server's failure must not lose the others
            results["servers"][name] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
        tick()
    return results


def table(results: dict) -> list[str]:
    """The markdown table of a run."""
    lines = [f"### Serving an agent trace over HTTP ({results['agents']} agents x "
             f"{results['turns']} turns, `{' '.join(results['serve_args'])}`)", "",
             "| server | TTFT p50 ms | TTFT p99 ms | output tokens/s | prompt tokens from cache "
             "| replies equal to max serve's |",
             "|---|---|---|---|---|---|"]
    reference = results["servers"].get("max serve", {}).get("replies")
    for name, r in results["servers"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][-120:]!r} | | | | |")
            continue
        same = "{} of {} turns".format(*same_replies(r["replies"], reference)) if reference else "-"
        lines.append(f"| {name} | {r['ttft_ms']['p50']} | {r['ttft_ms']['p99']} | "
                     f"{r['output_tokens_per_s']} | {r['cached_share']:.1%} | {same} |")
    return lines + [""]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gpu", action="store_true", help="bfloat16 weights on the GPU, MAX's defaults")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    result = run(a.quick, gpu=a.gpu)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "servers"} | {"servers": {
        n: {k: v for k, v in r.items() if k != "replies"} for n, r in result["servers"].items()}}, indent=1))
    print("\n".join(table(result)))
