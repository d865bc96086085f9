"""NullKVCacheManager (MAX's documented values) and load_kv_manager's choice of manager."""

import subprocess
import sys
import textwrap

import mokv
import numpy as np
import pytest
from max.driver import CPU
from mokv import TextContext

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
    assert type(cont) is mokv.ContinuousKVCacheManager
    with pytest.raises(ValueError, match="available_cache_memory is required"):
        mokv.load_kv_manager(small_params(), 2, 16, NUM_LAYERS, [CPU()], session)


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
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["NullKVCacheManager", "gpu:0"]
