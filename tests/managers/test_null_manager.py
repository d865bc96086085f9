"""NullKVCacheManager (MAX's documented values) and load_kv_manager's choice of manager."""

import subprocess
import sys
import textwrap

import mokv
import numpy as np
import pytest
from max.driver import CPU
from mokv import TextContext

from ..child_env import child_env
from .conftest import NUM_LAYERS, make_paged, small_params


@pytest.fixture
def null(session):
    return mokv.NullKVCacheManager(small_params(), 4, 32, NUM_LAYERS, [CPU()], session, 10**6)


def test_documented_return_values(null):
    ctx = TextContext(np.arange(5))
    assert null.claim(ctx.request_id) is None and null.contains(ctx.request_id)
    assert null.alloc(ctx) is None and null.maybe_reserve(ctx)
    assert (null.free_blocks_pct, null.used_blocks_pct, null.num_free_blocks) == (1.0, 0.0, 1000)
    assert (null.total_num_host_pages, null.host_committed_block_pct) == (0, 0.0)
    assert null.get_or_recommend_replica(ctx) == 0 and null.get_replica(ctx) == 0
    assert null.get_req_blocks(ctx.request_id) == []
    assert null.get_data_parallel_splits([ctx, ctx]).to_numpy().tolist() == [0, 2]
    assert mokv.NullKVCacheManager.estimated_memory_size(null.params, 4, 32, 2, 10**9, []) == 0
    assert mokv.NullKVCacheManager.infer_optimal_batch_size(null.params, 32, 2, 10**9, []) == 1
    assert null.step([ctx]) is None and null.reset_prefix_cache() is True
    assert null.metrics == mokv.KVCacheMetrics()
    null.release(ctx.request_id)
    assert not null.contains(ctx.request_id)


def test_seed_001_a_pipeline_drives_it_without_claiming(null):
    """Issue 56: seed 001 says `get_replica` "always returns 0", `get_req_blocks` is empty
    and `step` / `release` do nothing; mokv raised UnknownRequestError for a request it
    was never told about, where MAX 25.7 answers."""
    ctx = TextContext(np.arange(5))  # never claimed
    assert null.get_replica(ctx) == 0 and null.get_req_blocks(ctx.request_id) == []
    assert null.step([ctx]) is None and null.release(ctx.request_id) is None
    assert null.maybe_reserve(ctx) and null.contains(ctx.request_id)  # recorded, as MAX's
    (inputs,) = null.fetch([ctx, TextContext(np.arange(3))])
    assert inputs.lookup_table.shape == (2, 1)
    null.claim(ctx.request_id)  # again: nothing to refuse, as MAX's
    null.release(ctx.request_id)
    assert not null.contains(ctx.request_id)
    # What no manager could take is still refused, naming it.
    with pytest.raises(TypeError, match="request_id must be a str.*int 7"):
        null.release(7)
    with pytest.raises(mokv.InvalidReplicaError, match="replica_idx=1"):
        null.claim("a", replica_idx=1)
    with pytest.raises(mokv.SequenceTooLongError):
        null.maybe_reserve(TextContext(np.arange(40)))


def test_symbolic_inputs_equal_the_paged_managers(session, null):
    assert null.get_symbolic_inputs() == make_paged(session).get_symbolic_inputs()
    assert null.input_symbols() == null.get_symbolic_inputs()


def test_runtime_inputs_are_empty_but_typed(null):
    batch = [TextContext(np.arange(5)), TextContext(np.arange(3))]
    for ctx in batch:
        null.claim(ctx.request_id)
    (inputs,) = null.get_runtime_inputs(batch, num_steps=3)
    (symbols,) = null.get_symbolic_inputs()
    for sym, buf in zip(symbols, inputs):
        assert sym.dtype == buf.dtype and sym.rank == buf.rank
    assert inputs.blocks.shape[0] == 0 and inputs.lookup_table.shape == (2, 1)
    assert inputs.max_lengths.shape == (3, 2)
    assert null.increment_cache_lengths([inputs], None) == [inputs]


def test_load_kv_manager_follows_the_strategy(session):
    paged = mokv.load_kv_manager(small_params(), 2, 16, NUM_LAYERS, [CPU()], session, 10**5)
    assert type(paged) is mokv.PagedKVCacheManager
    cont = mokv.load_kv_manager(small_params(cache_strategy=mokv.KVCacheStrategy.CONTINUOUS),
                                2, 16, NUM_LAYERS, [CPU()], session)
    assert type(cont) is mokv.ContinuousBatchingKVCacheManager  # both flows: below
    assert isinstance(cont, mokv.KVCacheManager)
    with pytest.raises(ValueError, match="available_cache_memory is required"):
        mokv.load_kv_manager(small_params(), 2, 16, NUM_LAYERS, [CPU()], session)
    with pytest.raises(TypeError, match="name the same setting"):
        mokv.load_kv_manager(small_params(), 2, 16, NUM_LAYERS, [CPU()], session, 10**5,
                             max_cache_batch_size=2)
    with pytest.raises(TypeError, match="needs max_seq_len"):
        mokv.load_kv_manager(small_params(), max_batch_size=2, num_layers=2, devices=[CPU()],
                             session=session)


def test_the_continuous_strategy_runs_maxs_own_continuous_tests(session):
    """Issue 56: MAX's continuous-cache tests (`test_kv_cache_manager.py` of the release
    of seed 002) drive what `load_kv_manager` returns by sequence ids; mokv returned the
    request-contract manager, which has no `claim(n=...)`. Their steps, as they call them:"""
    params = small_params(cache_strategy=mokv.KVCacheStrategy.CONTINUOUS)
    kv_manager = mokv.load_kv_manager(params=params, max_cache_batch_size=16, max_seq_len=100,
                                      num_layers=NUM_LAYERS, devices=[CPU()], session=session)
    with pytest.raises(ValueError):  # fetch of nothing claimed
        kv_manager.fetch(seq_ids=[0])
    seq_ids = kv_manager.claim(n=3)
    assert all(kv_manager.cache_lengths[s] == 0 for s in seq_ids)
    for j in range(3):
        kv_manager.step({s: v for s, v in zip(seq_ids, [3, 4, 7])})
        assert [kv_manager.cache_lengths[s] for s in seq_ids] == [3 * (j + 1), 4 * (j + 1),
                                                                  7 * (j + 1)]
    assert len(kv_manager.slots_remaining) == 13
    with pytest.raises(ValueError):
        kv_manager.release(seq_id=25)
    assert kv_manager.fetch(seq_ids[:2])[0] is not None
    for seq_id in seq_ids:
        kv_manager.release(seq_id=seq_id)
    assert len(kv_manager.slots_remaining) == 16
    # ... and the request contract on the same slots, as mokv's models drive it.
    ctx = TextContext(np.arange(5))
    kv_manager.claim(ctx.request_id)
    assert kv_manager.contains(ctx.request_id) and kv_manager.maybe_reserve(ctx)
    (inputs,) = kv_manager.fetch([ctx])
    assert inputs.cache_lengths.to_numpy().tolist() == [0]
    ctx.update(1)
    kv_manager.step([ctx])
    assert len(kv_manager.get_req_blocks(ctx.request_id)) == 1  # one slot
    assert len(kv_manager.slots_remaining) == 15 and kv_manager.metrics.input_tokens == 5
    kv_manager.release(ctx.request_id)
    assert not kv_manager.contains(ctx.request_id) and len(kv_manager.slots_remaining) == 16


def test_load_kv_manager_returns_the_null_manager_on_virtual_devices():
    # Virtual-device mode is process-wide, so it is turned on in a child process.
    script = textwrap.dedent("""
        from max import driver
        from max.driver import Accelerator
        from max.dtype import DType
        from max.engine import InferenceSession
        import mokv
        driver.set_virtual_device_api("cuda")
        driver.set_virtual_device_target_arch("sm_90")
        driver.set_virtual_device_count(1)
        gpu = Accelerator()
        params = mokv.KVCacheParams(DType.bfloat16, 8, 128, page_size=128)
        m = mokv.load_kv_manager(params, 8, 4096, 4, [gpu], InferenceSession(devices=[gpu]), 2**34)
        (sym,) = m.get_symbolic_inputs()
        print(type(m).__name__, sym.blocks.device, flush=True)
        import os
        os._exit(0)  # MAX can abort at shutdown after virtual-device use; all is printed
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=child_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["NullKVCacheManager", "gpu:0"]
