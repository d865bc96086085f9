"""Serve a stream of chat requests with a small decoder whose attention runs through mokv.

Requests arrive over time; many share one of a few long system prompts and some come
back for a second turn. The scheduler (mokv_graphs.Scheduler) admits a request when the
cache has room for it, batches prefill chunks and decode tokens under one token budget,
and preempts when pages run out. At the end a sample of outputs is checked against a
full recompute without any cache (the numpy reference decoder).

    python examples/generate.py                      # paged cache with prefix reuse, CPU
    python examples/generate.py --strategy continuous
    python examples/generate.py --pages 40           # fewer pages: watch preemptions
    python examples/generate.py --weights model.safetensors   # real weights, same shapes
    python examples/generate.py --weights Llama-3.2-1B/       # a Hugging Face checkpoint
"""

import argparse
import time
from pathlib import Path

import mokv
import numpy as np
from max.driver import CPU
from max.engine import InferenceSession
from mokv_graphs import (
    DecoderConfig,
    DecoderModel,
    Request,
    Scheduler,
    first_mismatch,
    greedy,
    init_weights,
    load_checkpoint,
    load_safetensors,
)
from rich.console import Console
from rich.progress import Progress

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--strategy", choices=["paged", "continuous"], default="paged")
parser.add_argument("--pages", type=int, default=64, help="page budget of the paged cache")
parser.add_argument("--requests", type=int, default=48, help="first-turn requests")
parser.add_argument("--page-size", type=int, default=16)
parser.add_argument("--max-batch", type=int, default=8)
parser.add_argument("--token-budget", type=int, default=128, help="rows per model call")
parser.add_argument("--check", type=int, default=4, help="outputs checked against a recompute")
parser.add_argument("--weights", help="Hugging Face checkpoint directory, or a safetensors file "
                    "(Llama names, DecoderConfig() shapes)")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
console = Console()
rng = np.random.default_rng(args.seed)

if args.weights and Path(args.weights).is_dir():  # a Hugging Face checkpoint directory
    config, weights = load_checkpoint(args.weights)
else:
    config = DecoderConfig()
    weights = load_safetensors(args.weights, config) if args.weights else init_weights(config)
params = config.kv_params(args.strategy, page_size=args.page_size)
session = InferenceSession(devices=[CPU()])
manager = mokv.load_kv_manager(
    params, max_batch_size=args.max_batch, max_seq_len=384, num_layers=config.num_layers,
    devices=[CPU()], session=session, page_size=args.page_size,
    available_cache_memory=args.pages * params.bytes_per_page(config.num_layers),
)
with console.status("Compiling the decoder graph (once; cached on disk afterwards)..."):
    start = time.perf_counter()
    model = DecoderModel(config, manager, session, weights)
console.print(f"Compiled {model.graph.name} in {time.perf_counter() - start:.1f} s")


def tokens(n_min: int, n_max: int) -> np.ndarray:
    return rng.integers(0, config.vocab_size, int(rng.integers(n_min, n_max)))


# The workload: request i arrives at step arrivals[i]; a quarter come back for a 2nd turn.
system_prompts = [tokens(96, 160) for _ in range(3)]
arrivals = np.cumsum(rng.exponential(1.5, args.requests)).astype(int)
pending = [
    (int(step), Request(mokv.TextContext(np.r_[system_prompts[i % 3], tokens(8, 40)]),
                        int(rng.integers(16, 48))))
    for i, step in enumerate(arrivals)
]
second_turn = {id(req): tokens(8, 24) for _, req in pending[::4]}

scheduler = Scheduler(manager, greedy(model.step), token_budget=args.token_budget)
done: list[Request] = []
peak_pages = step = 0
start = time.perf_counter()
with Progress(console=console) as progress:
    task = progress.add_task("Serving", total=len(pending) + len(second_turn))
    while pending or scheduler.has_work:
        while pending and pending[0][0] <= step:
            scheduler.add(pending.pop(0)[1])
        for req in scheduler.step():
            done.append(req)
            progress.advance(task)
            if id(req) in second_turn:  # the user answers: a new request on the whole chat
                follow_up = np.r_[req.ctx.tokens, second_turn.pop(id(req))]
                pending.insert(0, (step + 1, Request(mokv.TextContext(follow_up), 24)))
        peak_pages = max(peak_pages, manager.metrics.used_pages)
        progress.update(task, description=f"Serving ({scheduler.stats.generated_tokens} tokens)")
        step += 1
elapsed = time.perf_counter() - start

stats, metrics = scheduler.stats, manager.metrics
console.print(f"[bold]{len(done)} requests[/] in {elapsed:.1f} s, {stats.steps} model calls")
console.print(
    f"  generated {stats.generated_tokens} tokens: "
    f"{stats.generated_tokens / elapsed:.0f} tokens/s "
    f"({stats.computed_tokens / elapsed:.0f} rows/s incl. prefill)"
)
if isinstance(manager, mokv.PagedKVCacheManager):
    console.print(
        f"  prefix-cache hit rate {metrics.cache_hit_rate:.0%} of prompt tokens; "
        f"peak {peak_pages} of {manager.total_num_pages} pages in use"
    )
else:
    console.print(f"  continuous slots: peak {peak_pages} of {args.max_batch} in use (no prefix reuse)")
console.print(f"  requests preempted: {stats.preemptions}")

# Greedy decoding is deterministic: with the outputs fed back in, one reference forward
# pass over prompt + output must predict every output token (a full recompute, no cache).
sample = [done[int(i)] for i in rng.choice(len(done), min(args.check, len(done)), replace=False)]
for req in sample:
    ok = first_mismatch(config, weights, req.ctx.tokens, req.prompt_len) is None
    console.print(f"  check {req.ctx.request_id[:8]} ({req.prompt_len}+{req.output.size} tokens): "
                  + ("[green]matches the uncached recompute[/]" if ok else "[red]MISMATCH[/]"))
    if not ok:
        raise SystemExit(1)
