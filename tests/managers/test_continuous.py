"""ContinuousKVCacheManager: the request contract over one contiguous slot per request."""

import mokv
import numpy as np
import pytest
from max.driver import CPU
from mokv import TextContext

from .conftest import NUM_LAYERS, small_params


@pytest.fixture
def cont(session):
    params = small_params(cache_strategy="continuous")
    return mokv.ContinuousKVCacheManager(params, 3, 16, NUM_LAYERS, [CPU()], session)


def test_block_shape_and_memory(cont):
    assert cont.block_shape(5) == [5, 2, NUM_LAYERS, 16, 2, 8]
    assert cont.blocks[0].shape == (3, 2, NUM_LAYERS, 16, 2, 8)
    # 3 slots * 16 tokens * (2 * 2 layers * 2 heads * 8 dims * 4 bytes)
    cls = mokv.ContinuousKVCacheManager
    assert cls.estimated_memory_size(cont.params, 3, 16, NUM_LAYERS, []) == 3 * 16 * 256
    assert cls.infer_optimal_batch_size(cont.params, 16, NUM_LAYERS, 10 * 16 * 256 + 1, []) == 10


def test_context_flow_matches_the_paged_manager(cont):
    a = TextContext(np.arange(4))
    cont.external_claim(a.request_id)
    assert cont.maybe_reserve(a, num_steps=2)
    (inputs,) = cont.fetch([a])
    assert inputs.cache_lengths.to_numpy().tolist() == [0]
    assert inputs.is_cache_empty.to_numpy().tolist() == [True]
    a.update(9)
    cont.step([a])
    assert cont.fetch([a])[0].cache_lengths.to_numpy().tolist() == [4]
    assert cont.get_req_blocks(a.request_id) == [inputs.lookup_table.to_numpy()[0]]
    assert cont.metrics.input_tokens == 4 and cont.metrics.cache_hit_rate == 0.0  # the prompt
    assert cont.contains(a.request_id) and cont.get_replica(a) == 0
    cont.release(a.request_id)
    assert not cont.contains(a.request_id) and cont.num_free_blocks == 3


def test_input_symbols_match_fetch(cont):
    a = TextContext(np.arange(3))
    cont.external_claim(a.request_id)
    (symbols,) = cont.input_symbols()
    (buffers,) = cont.fetch([a])
    for sym, buf in zip(symbols, buffers):
        assert sym.dtype == buf.dtype and sym.rank == buf.rank


def test_increment_cache_lengths(cont):
    a, b = TextContext(np.arange(4)), TextContext(np.arange(1))
    for ctx in (a, b):
        cont.external_claim(ctx.request_id)
    inputs = cont.fetch([a, b])
    nxt = cont.increment_cache_lengths(inputs, np.array([0, 4, 5], dtype=np.uint32))
    assert nxt[0].cache_lengths.to_numpy().tolist() == [4, 1]
    assert nxt[0].is_cache_empty.to_numpy().tolist() == [False]


def test_bad_input_is_rejected_and_changes_nothing(cont):
    long = TextContext(np.arange(17))
    cont.external_claim(long.request_id)
    with pytest.raises(mokv.SequenceTooLongError, match="max_seq_len=16"):
        cont.maybe_reserve(long)
    with pytest.raises(mokv.AlreadyClaimedError):
        cont.external_claim(long.request_id)
    with pytest.raises(mokv.InvalidReplicaError):
        cont.external_claim(mokv.RequestID("x"), replica_idx=1)
    for call in (cont.contains, cont.release, cont.external_claim):
        with pytest.raises(TypeError, match="request_id must be a str.*int 0.*sequence ids"):
            call(0)  # an int is a sequence id: ContinuousBatchingKVCacheManager's
    assert cont.num_free_blocks == 2 and not cont.contains(mokv.RequestID("x"))
    with pytest.raises(ValueError, match="data_parallel_degree=2"):
        mokv.ContinuousKVCacheManager(
            small_params(data_parallel_degree=2, n_devices=2), 2, 16, 1, [CPU()] * 2, cont.session
        )
