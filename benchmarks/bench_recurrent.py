"""Prefix caching of a hybrid linear-attention model's cache, side by side on one trace
(issue 55, item 4).

A Qwen3.5-like cache, small: 1 full-attention layer beside 3 linear-attention layers
(MAX's `MultiKVCacheParams` of an "attn" `MHAKVCacheParams` and a "state"
`RecurrentStateParams`: a conv region and a delta-rule region), pages of 128 tokens.
Four managers, the same bytes, the same trace:

- **mokv, every page**: `mokv.pipelines.load_kv_manager` with a checkpoint wherever a
  forward ends on a page boundary (`state_checkpoints: checkpoint_every 1`);
- **mokv, every 4 pages**: only on boundaries of 4 pages;
- **mokv, no checkpoints**: `num_checkpoints 0` (the attention pages are cached, but no
  prefix can be resumed without the state at its end);
- **MAX 26.7, Jenga**: MAX's own manager on the same tree (it checkpoints at every page
  boundary a forward ends on).

The trace: requests of a shared system prompt (one of 4, 1,000 tokens) and 500 tokens
of their own, one at a time, prefilled in forwards of 256 tokens (MAX's chunked
prefill) and decoded for 8 tokens. The figures: prefix-hit rate (prompt tokens served
from the cache / prompt tokens), prefill tokens computed, the state's bytes (one state,
the unit of a checkpoint) and the checkpoints a request leaves, and the memory of one
checkpoint of the real Qwen3.5-27B (bfloat16, MAX's own region geometry).
"""

from __future__ import annotations

import numpy as np
from tables import side_table

PAGE, CHUNK, SYSTEM, OWN, DECODE, N_SYSTEMS = 128, 256, 1000, 500, 8, 4
RUNS = {"mokv, every page": (1, 64), "mokv, every 4 pages": (4, 64),
        "mokv, no checkpoints": (1, 0), "MAX 26.7, Jenga": None}


def tree():
    from max.dtype import DType
    from max.graph import DeviceRef
    from max.nn.kv_cache import (
        MHAKVCacheParams,
        MultiKVCacheParams,
        RecurrentStateParams,
        RecurrentStateRegion,
    )

    cpu = [DeviceRef.CPU()]
    attn = MHAKVCacheParams(dtype=DType.float32, num_layers=1, devices=cpu, page_size=PAGE,
                            enable_prefix_caching=True, n_kv_heads=2, head_dim=16)
    state = RecurrentStateParams(regions=(
        RecurrentStateRegion("conv", 3, (96, 3), DType.float32),
        RecurrentStateRegion("ssm", 3, (4, 16, 16), DType.float32)), devices=cpu)
    return MultiKVCacheParams.from_params({"attn": attn, "state": state})


def qwen35_27b_state_bytes() -> int:
    """One request's state of Qwen3.5-27B (48 linear-attention layers, bfloat16), by
    MAX's own region geometry (`qwen3_5.state_cache.linear_state_regions`)."""
    from max.dtype import DType
    from max.pipelines.architectures.qwen3_5.state_cache import linear_state_regions

    regions = linear_state_regions(num_linear_layers=48, key_head_dim=128, num_key_heads=16,
                                   value_head_dim=128, num_value_heads=48, conv_kernel_dim=4,
                                   dtype=DType.bfloat16, num_devices=1)
    return sum(region.bytes_per_page for region in regions)


def manager(run, budget: int):
    from max.driver import CPU
    from max.engine import InferenceSession
    from max.pipelines.kv_cache import load_kv_manager as max_loader
    from mokv.pipelines import MokvOptions
    from mokv.pipelines import load_kv_manager as mokv_loader

    args = dict(params=tree(), max_batch_size=1, max_seq_len=2048,
                session=InferenceSession(devices=[CPU()]), available_cache_memory=budget,
                is_di_enabled=False, model_name="qwen35-like", max_num_input_tokens=None)
    if run is None:
        return max_loader(**args)
    every, count = run
    options = MokvOptions.from_mapping(
        {"state_checkpoints": {"checkpoint_every": every, "num_checkpoints": count}})
    return mokv_loader(**args, options=options)


def make_trace(num_requests: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, 30000, SYSTEM) for _ in range(N_SYSTEMS)]
    return [np.concatenate([systems[i % N_SYSTEMS], rng.integers(3, 30000, OWN)])
            for i in range(num_requests)]


def replay(m, trace: list[np.ndarray]) -> dict:
    """Runs the trace, one request at a time, on `m` (MAX's manager interface)."""
    from max.pipelines.context import TextContext, TokenBuffer

    hit_tokens = prompt_tokens = 0
    for prompt in trace:
        ctx = TextContext(max_length=2048, tokens=TokenBuffer(prompt.astype(np.int64)))
        m.claim(ctx)
        first = True
        while ctx.tokens.generated_length < DECODE:
            m.alloc(ctx)
            if first:
                hit_tokens, first = hit_tokens + ctx.cached_prefix_length, False
            if ctx.tokens.active_length > CHUNK:
                ctx.tokens.chunk(CHUNK)
            m.runtime_inputs([[ctx]])
            ctx.update(7)
            m.step(ctx)
        m.release(ctx)
        prompt_tokens += len(prompt)
    inner = getattr(m, "manager", None)  # mokv.pipelines.KVCacheManager's own manager
    states = inner.replicas[0].states if inner is not None else None
    out = {"hit_rate": round(hit_tokens / prompt_tokens, 3),
           "prefill_tokens": prompt_tokens - hit_tokens, "saved_tokens": hit_tokens}
    if states is not None:
        out["state_bytes"] = states.config.bytes_per_state
        out["checkpoints_per_request"] = round(states.checkpoints_taken / len(trace), 2)
        out["checkpoints_held"] = states.pool.num_cached
    return out


def run(quick: bool, progress=None) -> dict:
    num_requests = 8 if quick else 32
    budget = 8 << 20
    out: dict = {"config": {"page_size": PAGE, "chunk": CHUNK, "shared_prefix": SYSTEM,
                            "own_tokens": OWN, "prefixes": N_SYSTEMS, "requests": num_requests,
                            "budget_MiB": budget >> 20,
                            "qwen35_27b_state_MiB": round(qwen35_27b_state_bytes() / 2**20, 1)},
                 "managers": {}}
    trace = make_trace(num_requests)
    for name, spec in RUNS.items():
        out["managers"][name] = measure(spec, budget, trace)
        if progress:
            progress()
    return out


def measure(spec, budget: int, trace: list[np.ndarray]) -> dict:
    """`replay` on a fresh manager of `spec`; its error as text if it fails (reported
    beside the others)."""
    m = manager(spec, budget)
    try:
        return replay(m, trace)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:600]}
    finally:
        m.shutdown()


def table(r: dict) -> list[str]:
    """The markdown table of `run`'s result."""
    c = r["config"]
    title = (f"A hybrid linear-attention cache ({c['requests']} requests of {c['shared_prefix']} "
             f"shared + {c['own_tokens']} own tokens, {c['prefixes']} prefixes, prefill in "
             f"forwards of {c['chunk']}, pages of {c['page_size']}; one Qwen3.5-27B "
             f"checkpoint: {c['qwen35_27b_state_MiB']} MiB)")
    columns = ["manager", "prefix-hit rate", "prefill tokens", "tokens saved", "state bytes",
               "checkpoints / request"]
    return side_table(title, columns, r["managers"], lambda s: [
        f"{s['hit_rate']:.3f}", s["prefill_tokens"], s["saved_tokens"],
        s.get("state_bytes", "-"), s.get("checkpoints_per_request", "-")], error_chars=160)


if __name__ == "__main__":
    import json
    import sys

    result = run("--quick" in sys.argv)
    print(json.dumps(result, indent=1))
    print("\n".join(table(result)))
