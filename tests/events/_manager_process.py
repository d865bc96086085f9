"""A manager process for test_processes.py: publishes events while it runs a random
workload, prints its own hash index, and keeps its replay socket up until told to stop.

argv: port replay_port seed steps. stdin: a line to start, a line to stop.
stdout: one JSON line {"last_seq": [per replica], "hashes": [[...] per replica]}.
"""

import json
import sys

import mokv
import numpy as np
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession

port, replay_port, seed, steps = map(int, sys.argv[1:5])
DP, PAGE, PAGES, MAX_LEN = 2, 4, 24, 48
params = mokv.KVCacheParams(DType.float32, 1, 4, page_size=PAGE, enable_prefix_caching=True,
                            data_parallel_degree=DP, n_devices=DP)
config = mokv.KVEventsConfig(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}")
m = mokv.PagedKVCacheManager(params, 4 * DP, MAX_LEN, 1, [CPU()] * DP,
                             InferenceSession(devices=[CPU()]),
                             DP * PAGES * params.bytes_per_page(1), page_size=PAGE,
                             kv_events_config=config, enable_runtime_checks=True)
sys.stdin.readline()
rng = np.random.default_rng(seed)
shared = [list(rng.integers(0, 5, 10)) for _ in range(3)]
running: list = []
for _step in range(steps):
    if len(running) < 6 and rng.random() < 0.6:
        prompt = shared[rng.integers(3)][: rng.integers(1, 11)] + list(rng.integers(0, 5, rng.integers(1, 9)))
        ctx = mokv.TextContext(prompt, cache_salt=[None, "tenant-a"][rng.integers(2)])
        m.external_claim(ctx.request_id)
        running.append(ctx)
    batch = []
    for ctx in list(running):
        if m.maybe_reserve(ctx):
            batch.append(ctx)
        else:  # no room: preempt it
            m.release(ctx.request_id)
            running.remove(ctx)
    batch.sort(key=m.get_replica)
    if batch:
        m.fetch(batch)
        for ctx in batch:
            ctx.update(int(rng.integers(0, 5)))
        m.step(batch)
    for ctx in list(running):
        if ctx.end_idx >= MAX_LEN - 2 or rng.random() < 0.08:
            m.release(ctx.request_id)
            running.remove(ctx)
    if rng.random() < 0.005:
        m.reset_prefix_cache()
pubs = m.kv_event_publishers
print(json.dumps({"last_seq": [p.last_seq for p in pubs],
                  "hashes": [sorted(r.pool.indexed_hashes()) for r in m.replicas]}), flush=True)
sys.stdin.readline()
m.close()
