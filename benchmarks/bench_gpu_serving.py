"""The host tier's copies and a decoder's tokens per second on a GPU.

Runs where MAX sees an accelerator (`max.driver.accelerator_count() > 0`):

    python benchmarks/bench_gpu_serving.py [--json PATH] [--lock PATH]

- **host tier**: GB/s of `HostPages.offload` / `load` (pinned host pages, one
  `batch_inplace_copy` per batch) of 32 scattered 2 MiB pages, next to one pinned
  host-to-device copy of the same bytes in one piece.
- **decoder**: the example decoder (`mokv_graphs.DecoderConfig()`, float32, 4 layers of
  256) on a paged mokv manager on the GPU: decode steps (manager `maybe_reserve` and
  `fetch`, the model, `step`) at batch 1 and 32 with 512-token prompts, in tokens per
  second and ms per step. A model this small is bound by launches and the host, not the
  GPU: the figure is mokv's per-step cost around a real graph.

`--lock`: as in bench_gpu_attention.py, the timings take turns with other processes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mokv  # noqa: E402
import mokv_graphs as mg  # noqa: E402
import numpy as np  # noqa: E402
from bench_gpu_attention import _exclusive  # noqa: E402
from max.driver import CPU, Accelerator, Buffer, accelerator_count  # noqa: E402
from max.dtype import DType  # noqa: E402
from max.engine import InferenceSession  # noqa: E402
from mokv.cache.page_copy import HostPages  # noqa: E402


def host_tier(gpu, num_pages: int = 32, repeats: int = 5) -> dict:
    """GB/s of offload and load of `num_pages` scattered pages, vs one pinned copy."""
    page_shape = [2, 8, 128, 2, 128]  # 8 layers, 2 KV heads of 128: 2 MiB per float32 page
    device = Buffer(DType.float32, [2 * num_pages, *page_shape], device=gpu)
    host = HostPages(DType.float32, 2 * num_pages, page_shape, [gpu])
    rng = np.random.default_rng(0)
    dev_ids = rng.permutation(2 * num_pages)[:num_pages].tolist()
    host_ids = list(range(num_pages))
    nbytes = num_pages * host.bytes_per_page
    rest = (slice(None),) * len(page_shape)  # Buffer slicing wants every dimension
    first = (slice(0, num_pages),) + rest
    whole, target = host.buffers[0][first], device[first]

    def best(fn) -> float:
        times = []
        for _ in range(repeats + 1):
            gpu.synchronize()
            t0 = time.perf_counter()
            fn()
            gpu.synchronize()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times[1:]) / 1e9

    one_copy = best(lambda: target.inplace_copy_from(whole))
    offload = best(lambda: host.offload([device], dev_ids, host_ids))
    load = best(lambda: host.load(host_ids, [device], dev_ids))
    return {"MiB_per_batch": nbytes // 2**20, "pinned": host.buffers[0].pinned,
            "one_copy_GBps": round(one_copy, 2), "offload_GBps": round(offload, 2),
            "load_GBps": round(load, 2)}


def _step(manager, model, ctxs) -> None:
    """One serving step of `ctxs`: reserve, fetch, run, greedy token, commit."""
    for ctx in ctxs:
        assert manager.maybe_reserve(ctx)
    logits = model.execute(ctxs, manager.fetch(ctxs))
    for ctx, row in zip(ctxs, logits):
        ctx.update(int(np.argmax(row)))
    manager.step(ctxs)


def decoder(gpu, session, lock: str | None, batches=(1, 32), prompt: int = 512,
            steps: int = 32) -> list[dict]:
    """Decode tokens per second of the example decoder on a paged manager on the GPU."""
    config = mg.DecoderConfig()
    params = config.kv_params("paged", page_size=128)
    pages = max(batches) * -(-(prompt + steps + 1) // 128)
    manager = mokv.PagedKVCacheManager(
        params, max_batch_size=max(batches), max_seq_len=config.max_seq_len,
        num_layers=config.num_layers, devices=[gpu], session=session,
        available_cache_memory=pages * params.bytes_per_page(config.num_layers))
    model = mg.DecoderModel(config, manager, session, mg.init_weights(config))
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        ctxs = [mokv.TextContext(rng.integers(0, config.vocab_size, prompt)) for _ in range(batch)]
        for ctx in ctxs:
            manager.external_claim(ctx.request_id)
        with _exclusive(lock):  # compiled above: only the timing takes turns
            _step(manager, model, ctxs)  # the prefill
            _step(manager, model, ctxs)  # a first decode step: warm
            t0 = time.perf_counter()
            for _ in range(steps):
                _step(manager, model, ctxs)
            sec = (time.perf_counter() - t0) / steps
        rows.append({"batch": batch, "prompt": prompt, "ms_per_step": round(sec * 1e3, 3),
                     "tokens_per_s": round(batch / sec, 1)})
        print(json.dumps(rows[-1]), flush=True)
        for ctx in ctxs:
            manager.release(ctx.request_id)
    return rows


if __name__ == "__main__":
    if accelerator_count() == 0:
        sys.exit("no accelerator: this benchmark runs on a GPU")
    lock = sys.argv[sys.argv.index("--lock") + 1] if "--lock" in sys.argv else None
    gpu = Accelerator()
    session = InferenceSession(devices=[CPU(), gpu])
    out: dict = {"device": str(gpu), "errors": {}}
    with _exclusive(lock):
        out["host_tier"] = host_tier(gpu)
    print(json.dumps(out["host_tier"]), flush=True)
    try:
        out["decoder"] = decoder(gpu, session, lock)
    except Exception as e:  # noqa: BLE001 - reported with the rest
        out["errors"]["decoder"] = f"{type(e).__name__}: {str(e)[:600]}"
    print(json.dumps(out["errors"]), flush=True)
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(out, indent=1))
