"""The two manager flows of the MAX documentation, on the CPU, with the state they leave.

1. Paged cache: two requests on two data-parallel replicas, reserve, fetch,
   update, step, release; then a third request that reuses the first one's prefix.
2. Continuous-batching cache, MAX's sequence-id flow: claim sequence ids, fetch, step, release.
"""

import mokv
import numpy as np
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession
from mokv import TextContext

NUM_LAYERS = 2
session = InferenceSession(devices=[CPU()])


def show(title, kv_cache_inputs):
    print(f"  {title}:")
    for device_idx, inputs in enumerate(kv_cache_inputs):
        table = inputs.lookup_table.to_numpy()
        if table.ndim == 2:  # paged: the pages the steps use, then MAX's padding columns
            page_size = inputs.blocks.shape[3]
            used = -(-int(inputs.max_lengths.to_numpy()[-1, 1]) // page_size)
            table = f"{table[:, :used].tolist()} (+ padding to {table.shape[1]} columns)"
        else:
            table = table.tolist()
        print(f"    device {device_idx}: blocks {tuple(inputs.blocks.shape)}, "
              f"cache_lengths {inputs.cache_lengths.to_numpy().tolist()}, lookup_table {table}")


print("1. PagedKVCacheManager: 2 replicas, 16-token pages, prefix caching on")
params = mokv.KVCacheParams(
    dtype=DType.float32, n_kv_heads=2, head_dim=64, page_size=16,
    enable_prefix_caching=True, data_parallel_degree=2, n_devices=2,
)
kv_manager = mokv.PagedKVCacheManager(
    params, max_batch_size=4, max_seq_len=256, num_layers=NUM_LAYERS,
    devices=[CPU(), CPU()], session=session,
    available_cache_memory=64 * params.bytes_per_page(NUM_LAYERS),
)
print(f"  {kv_manager.num_free_blocks} free pages of {params.bytes_per_page(NUM_LAYERS)} bytes")
system_prompt = np.arange(40)
ctx1 = TextContext(np.concatenate([system_prompt, [1000, 1001]]))
ctx2 = TextContext(np.arange(500, 520))

kv_manager.external_claim(ctx1.request_id, replica_idx=0)
kv_manager.external_claim(ctx2.request_id, replica_idx=1)
# Allocate blocks for these requests
kv_manager.maybe_reserve(ctx1, num_steps=10)
kv_manager.maybe_reserve(ctx2, num_steps=10)
# Get KVCache inputs to feed to graph
kv_cache_inputs = kv_manager.fetch([ctx1, ctx2], num_steps=10)
show("fetch([ctx1, ctx2], num_steps=10)", kv_cache_inputs)
# Run model...
# Update requests with newly generated tokens
ctx1.update(42)
ctx2.update(42)
# Commit newly written blocks to prefix cache
kv_manager.step([ctx1, ctx2])
# Release metadata and KV blocks for these requests
kv_manager.release(ctx1.request_id)
kv_manager.release(ctx2.request_id)
print(f"  after release: {kv_manager.num_free_blocks} free pages, {kv_manager.metrics}")

ctx3 = TextContext(np.concatenate([system_prompt, [2000]]))
replica = kv_manager.get_or_recommend_replica(ctx3)
kv_manager.external_claim(ctx3.request_id, replica_idx=replica)
kv_manager.maybe_reserve(ctx3)
print(f"  ctx3 shares the system prompt: replica {replica}, start_idx={ctx3.start_idx} "
      f"(tokens reused), pages {kv_manager.get_req_blocks(ctx3.request_id)}")
print(f"  hit rate so far: {kv_manager.metrics.cache_hit_rate:.2f}")
kv_manager.release(ctx3.request_id)

print("\n2. ContinuousBatchingKVCacheManager: one 256-token slot per sequence")
cont_params = mokv.KVCacheParams(dtype=DType.float32, n_kv_heads=2, head_dim=64,
                                 cache_strategy=mokv.KVCacheStrategy.CONTINUOUS)
cb_manager = mokv.ContinuousBatchingKVCacheManager(
    cont_params, max_cache_batch_size=4, max_seq_len=256, num_layers=NUM_LAYERS,
    devices=[CPU()], session=session,
)
print(f"  block_shape(4) = {cb_manager.block_shape(4)}")
seq_ids = cb_manager.claim(2)
show(f"fetch({seq_ids})", cb_manager.fetch(seq_ids))
cb_manager.step({seq_ids[0]: 12, seq_ids[1]: 7})  # context encoding wrote 12 and 7 tokens
show("after step({0: 12, 1: 7})", cb_manager.fetch(seq_ids))
for seq_id in seq_ids:
    cb_manager.release(seq_id)
print(f"  after release: {cb_manager.num_free_blocks} free slots")
