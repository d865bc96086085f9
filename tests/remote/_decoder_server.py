"""One mokv server of test_decoder_servers.py, in its own process: a paged manager with
the shared tier on, the small decoder of tests/model, and the scheduler.

Run as `python -m tests.remote._decoder_server URL NAMESPACE` from the repository root
(URL: one server's, or a Redis Cluster's seed URLs joined by commas).
stdin: one JSON line per batch of work, {"prompts": [[token ids], ...], "max_new": n}.
stdout: "ready", then one JSON line per batch, after its pages were sent to Redis:
{"tokens": [[prompt + generated], ...], "remote_cache_tokens": the tokens the manager
loaded from the store, "remote": the stores' counters}.
"""

import dataclasses
import json
import sys

import mokv
import mokv_graphs as mg
import numpy as np
from max.driver import CPU
from max.engine import InferenceSession
from mokv.tiers.remote import RemoteTier

from tests.model.conftest import CONFIG, MAX_BATCH_SIZE, MAX_SEQ_LEN, PAGE_SIZE
from tests.mojo_defines import set_default_mokv_defines

DEVICE_PAGES = 40
BREAKER_COOLDOWN_S = 0.5  # the test waits for the breaker's trial after a restart

url, namespace = sys.argv[1:3]
seeds = tuple(url.split(","))
params = dataclasses.replace(
    CONFIG.kv_params("paged", page_size=PAGE_SIZE, enable_prefix_caching=True),
    tiers=(mokv.RemoteTierConfig(url=url if len(seeds) == 1 else seeds, namespace=namespace),),
)
session = InferenceSession(devices=[CPU()])
set_default_mokv_defines(session)  # the suite's compiled decoder, from MAX's cache
manager = mokv.load_kv_manager(
    params, max_batch_size=MAX_BATCH_SIZE, max_seq_len=MAX_SEQ_LEN,
    num_layers=CONFIG.num_layers, devices=[CPU()], session=session,
    available_cache_memory=DEVICE_PAGES * params.bytes_per_page(CONFIG.num_layers),
    page_size=PAGE_SIZE, enable_runtime_checks=True,
)
assert isinstance(manager, mokv.PagedKVCacheManager)  # a paged cache with a shared tier
tiers = [replica.tiers.named("remote") for replica in manager.replicas]
stores = [store for tier in tiers if isinstance(tier, RemoteTier) for store in tier.stores]
for store in stores:
    store.nodes.set_cooldown(BREAKER_COOLDOWN_S)
model = mg.DecoderModel(CONFIG, manager, session, mg.init_weights(CONFIG, seed=1))
print("ready", flush=True)
for line in sys.stdin:
    work = json.loads(line)
    requests = [mg.Request(mokv.TextContext(np.array(p)), work["max_new"])
                for p in work["prompts"]]
    scheduler = mg.Scheduler(manager, mg.greedy(model.step), token_budget=64)
    for request in requests:
        scheduler.add(request)
    while scheduler.has_work:
        scheduler.step()
    for store in stores:
        store.flush(10)
    manager.check_invariants()
    print(json.dumps({
        "tokens": [r.ctx.tokens[: r.ctx.end_idx].tolist() for r in requests],
        "remote_cache_tokens": manager.metrics.remote_cache_tokens,
        "remote": manager.remote_metrics.as_dict(),
    }), flush=True)
manager.close()
