"""ContinuousBatchingKVCacheManager: MAX's sequence-id flow and the request (context) flow."""

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType

import mokv
from mokv import TextContext

from .conftest import NUM_LAYERS, small_params


@pytest.fixture
def cont(session):
    params = small_params(cache_strategy="continuous")
    return mokv.ContinuousBatchingKVCacheManager(params, 3, 16, NUM_LAYERS, [CPU()], session)


def test_block_shape_and_memory(cont):
    assert cont.block_shape(5) == [5, 2, NUM_LAYERS, 16, 2, 8]
    assert cont.blocks[0].shape == (3, 2, NUM_LAYERS, 16, 2, 8)
    # 3 slots * 16 tokens * (2 * 2 layers * 2 heads * 8 dims * 4 bytes)
    cls = mokv.ContinuousBatchingKVCacheManager
    assert cls.estimated_memory_size(cont.params, 3, 16, NUM_LAYERS, []) == 3 * 16 * 256
    assert cls.infer_optimal_batch_size(cont.params, 16, NUM_LAYERS, 10 * 16 * 256 + 1, []) == 10


def test_seed_002_sequence_id_flow(cont):
    seq_ids = cont.claim(2)
    assert seq_ids == [0, 1] and cont.num_free_blocks == 1
    blocks, cache_lengths, lookup_table, is_cache_empty = cont.fetch(seq_ids)[0]
    assert isinstance(blocks, Buffer) and blocks.dtype == DType.float32
    assert cache_lengths.to_numpy().tolist() == [0, 0]
    assert lookup_table.to_numpy().tolist() == [0, 1]
    assert is_cache_empty.to_numpy().tolist() == [True]
    cont.step({0: 5, 1: 3})
    cont.step({0: 1})
    _, cache_lengths, lookup_table, is_cache_empty = cont.fetch([1, 0])[0]
    assert cache_lengths.to_numpy().tolist() == [3, 6]
    assert lookup_table.to_numpy().tolist() == [1, 0]
    assert is_cache_empty.to_numpy().tolist() == [False]
    cont.release(0)
    assert cont.claim(1) == [0]
    assert cont.fetch([0])[0].cache_lengths.to_numpy().tolist() == [0]  # a fresh slot


def test_context_flow_matches_the_paged_manager(cont):
    a = TextContext(np.arange(4))
    cont.external_claim(a.request_id)
    assert cont.maybe_reserve(a, num_steps=2)
    (inputs,) = cont.fetch([a])
    assert inputs.cache_lengths.to_numpy().tolist() == [0]
    a.update(9)
    cont.step([a])
    assert cont.fetch([a])[0].cache_lengths.to_numpy().tolist() == [4]
    assert cont.get_req_blocks(a.request_id) == [inputs.lookup_table.to_numpy()[0]]
    assert cont.metrics.input_tokens == 5 and cont.metrics.cache_hit_rate == 0.0
    assert cont.contains(a.request_id) and cont.get_replica(a) == 0
    cont.release(a.request_id)
    assert not cont.contains(a.request_id) and cont.num_free_blocks == 3


def test_input_symbols_match_fetch(cont):
    (symbols,) = cont.input_symbols()
    (buffers,) = cont.fetch(cont.claim(1))
    for sym, buf in zip(symbols, buffers):
        assert sym.dtype == buf.dtype and sym.rank == buf.rank


def test_increment_cache_lengths(cont):
    inputs = cont.fetch(cont.claim(2))
    nxt = cont.increment_cache_lengths(inputs, np.array([0, 4, 5], dtype=np.uint32))
    assert nxt[0].cache_lengths.to_numpy().tolist() == [4, 1]
    assert nxt[0].is_cache_empty.to_numpy().tolist() == [False]


def test_bad_input_is_rejected_and_changes_nothing(cont):
    seq_ids = cont.claim(2)
    cont.step({seq_ids[0]: 10})
    with pytest.raises(mokv.UnknownRequestError, match="2"):
        cont.fetch([2])
    with pytest.raises(mokv.BatchTooLargeError, match="2 sequences: 1 of 3"):
        cont.claim(2)
    with pytest.raises(mokv.SequenceTooLongError, match="sequence 0 would hold 17"):
        cont.step({seq_ids[1]: 1, seq_ids[0]: 7})
    assert cont.fetch(seq_ids)[0].cache_lengths.to_numpy().tolist() == [10, 0]
    long = TextContext(np.arange(17))
    cont.external_claim(long.request_id)
    with pytest.raises(mokv.SequenceTooLongError, match="max_seq_len=16"):
        cont.maybe_reserve(long)
    with pytest.raises(mokv.AlreadyClaimedError):
        cont.external_claim(long.request_id)
    with pytest.raises(mokv.InvalidReplicaError):
        cont.external_claim(mokv.RequestID("x"), replica_idx=1)
    with pytest.raises(ValueError, match="data_parallel_degree=2"):
        mokv.ContinuousBatchingKVCacheManager(
            small_params(data_parallel_degree=2, n_devices=2), 2, 16, 1, [CPU()] * 2, cont.session
        )
