"""PagedKVCacheManager on the CPU device: MAX's documented example and every member."""

import mokv
import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from mokv import TextContext

from ..conftest import NUM_LAYERS, make_paged, small_params


def state(manager, contexts):
    """Everything a failed call must leave unchanged, read through public calls."""
    return (
        manager.num_free_blocks,
        manager.metrics,
        {c.request_id: manager.get_req_blocks(c.request_id) for c in contexts
         if manager.contains(c.request_id)},
        [[r.pool.page_hash(p) for p in range(r.pool.num_pages)] for r in manager.replicas],
    )


def test_seed_000_example_runs_verbatim(session):
    kv_manager = make_paged(session, data_parallel_degree=2, n_devices=2)
    ctx1, ctx2 = TextContext(np.arange(6)), TextContext(np.arange(7))
    kv_manager.external_claim(ctx1.request_id, replica_idx=0)
    kv_manager.external_claim(ctx2.request_id, replica_idx=1)
    # Allocate blocks for these requests
    kv_manager.maybe_reserve(ctx1, num_steps=10)
    kv_manager.maybe_reserve(ctx2, num_steps=10)
    # Get KVCache inputs to feed to graph
    kv_cache_inputs = kv_manager.fetch([ctx1, ctx2], num_steps=10)
    # Run model...
    # Update requests with newly generated tokens
    ctx1.update(42)
    ctx2.update(42)
    # Commit newly written blocks to prefix cache
    kv_manager.step([ctx1, ctx2])
    # Release metadata and KV blocks for these requests
    kv_manager.release(ctx1.request_id)
    kv_manager.release(ctx2.request_id)

    assert len(kv_cache_inputs) == 2  # one per device, replica 0 then replica 1
    for inputs, prompt_length in zip(kv_cache_inputs, [6, 7]):
        assert inputs.cache_lengths.to_numpy().tolist() == [0]
        # 6 or 7 prompt tokens + 9 more steps -> 15 or 16 tokens -> 4 pages of 4,
        # in a table padded to MAX's width: round_up(4, 8) + 16 columns
        assert inputs.lookup_table.to_numpy()[:, :4].tolist() == [[0, 1, 2, 3]]
        assert inputs.lookup_table.shape == (1, 24)
        # per step: (new tokens of the longest, cache + new tokens of the longest)
        assert inputs.max_lengths.to_numpy().tolist() == [[prompt_length, prompt_length]] + [
            [1, prompt_length + s] for s in range(1, 10)
        ]
    assert kv_manager.num_free_blocks == 32


def test_fetch_describes_the_batch_in_real_buffers(session, paged):
    a, b = TextContext(np.arange(5)), TextContext(np.arange(100, 102))
    for ctx in (a, b):
        paged.external_claim(ctx.request_id)
    inputs = paged.fetch([a, b])
    assert len(inputs) == 1
    blocks, cache_lengths, lookup_table, max_lengths = inputs[0]
    assert isinstance(blocks, Buffer) and blocks.shape == (16, 2, NUM_LAYERS, 4, 2, 8)
    assert blocks.dtype == DType.float32 and blocks.device == CPU()
    assert cache_lengths.to_numpy().tolist() == [0, 0]
    assert lookup_table.shape == (2, 24)  # 2 pages, padded as MAX pads: round_up(2, 8) + 16
    assert lookup_table.to_numpy()[:, :2].tolist() == [[0, 1], [2, 0]]  # b's unused entry: 0
    assert (lookup_table.to_numpy()[:, 2:] == 0).all()
    assert max_lengths.to_numpy().tolist() == [[5, 5]]
    assert paged.get_req_blocks(a.request_id) == [0, 1]
    a.update(7)
    paged.step([a])
    inputs = paged.fetch([a])
    assert inputs[0].cache_lengths.to_numpy().tolist() == [5]
    assert inputs[0].max_lengths.to_numpy().tolist() == [[1, 6]]


def test_input_symbols_match_fetched_buffers(paged):
    (symbols,) = paged.input_symbols()
    assert symbols == paged.get_symbolic_inputs()[0]
    ctx = TextContext([1, 2, 3])
    paged.claim(ctx.request_id)
    (buffers,) = paged.get_runtime_inputs([ctx])
    for sym, buf in zip(symbols, buffers):
        assert sym.dtype == buf.dtype and sym.rank == buf.rank
        for dim, size in zip(sym.shape, buf.shape):
            assert not str(dim).isdigit() or int(str(dim)) == size


def test_prefix_hit_shares_pages_and_skips_tokens(paged):
    prompt = np.arange(11)
    a = TextContext(prompt)
    paged.claim(a.request_id)
    paged.fetch([a])
    a.update(0)
    paged.step([a])  # 11 tokens cached: pages 0, 1 full and committed
    b = TextContext(np.concatenate([prompt[:8], [77, 78]]))
    paged.claim(b.request_id)
    assert paged.maybe_reserve(b)
    assert b.start_idx == 8 and b.next_tokens.tolist() == [77, 78]
    assert paged.get_req_blocks(b.request_id)[:2] == paged.get_req_blocks(a.request_id)[:2]
    pool = paged.replicas[0].pool
    assert [pool.ref_count(p) for p in paged.get_req_blocks(b.request_id)] == [2, 2, 1]
    m = paged.metrics  # a's 11 prompt tokens computed, b's first 8 found (MAX's meanings)
    assert (m.cache_tokens, m.input_tokens, m.prompt_tokens) == (8, 11, 19)
    assert m.cache_hit_rate == pytest.approx(8 / 19)
    paged.reset_metrics()
    assert paged.metrics.input_tokens == 0


def test_prefix_never_covers_the_last_token(paged):
    a = TextContext(np.arange(8))
    paged.claim(a.request_id)
    paged.fetch([a])
    a.update(8)
    paged.step([a])
    b = TextContext(np.arange(8))  # exactly two full cached pages
    paged.claim(b.request_id)
    paged.alloc(b)
    assert b.start_idx == 4 and b.active_length == 4  # the last page is recomputed


def test_no_prefix_caching_shares_nothing(session):
    m = make_paged(session, enable_prefix_caching=False)
    a, b = TextContext(np.arange(9)), TextContext(np.arange(9))
    for ctx in (a, b):
        m.claim(ctx.request_id)
    m.fetch([a])
    a.update(1)
    m.step([a])
    m.alloc(b)
    assert b.start_idx == 0 and not set(m.get_req_blocks(a.request_id)) & set(m.get_req_blocks(b.request_id))


def test_maybe_reserve_false_changes_nothing(session):
    m = make_paged(session, num_pages=8, max_seq_len=32)
    a, b = TextContext(np.arange(20)), TextContext(np.arange(50, 70))
    m.claim(a.request_id)
    m.claim(b.request_id)
    assert m.maybe_reserve(a)  # 5 pages
    before = state(m, [a, b]), (b.start_idx, b.active_idx)
    assert not m.maybe_reserve(b)  # 5 more do not fit in the 3 left
    assert (state(m, [a, b]), (b.start_idx, b.active_idx)) == before
    with pytest.raises(mokv.InsufficientPagesError):
        m.alloc(b)
    with pytest.raises(mokv.InsufficientPagesError):
        m.fetch([b])
    assert state(m, [a, b]) == before[0]


def test_reserved_request_never_runs_out_in_fetch(session):
    m = make_paged(session, num_pages=8)
    a = TextContext(np.arange(3))
    m.claim(a.request_id)
    assert m.maybe_reserve(a, num_steps=6)  # 3 + 5 tokens: 2 pages
    hog = TextContext(np.arange(100, 124))
    m.claim(hog.request_id)
    assert m.maybe_reserve(hog)  # the other 6 pages
    assert m.num_free_blocks == 0
    for step in range(6):
        m.fetch([a])
        a.update(step)
        m.step([a])


def test_chunked_prefill_commits_pages_that_others_reuse(paged):
    prompt = np.arange(14)
    a = TextContext(prompt)
    paged.claim(a.request_id)
    a.chunk(9)
    paged.fetch([a])
    a.update(-1)  # chunk done: 9 tokens cached, pages 0-1 full
    paged.step([a])
    b = TextContext(prompt)
    paged.claim(b.request_id)
    paged.alloc(b)
    assert b.start_idx == 8  # the pages a committed after its first chunk
    assert paged.get_req_blocks(b.request_id)[:2] == paged.get_req_blocks(a.request_id)[:2]


def test_preempted_request_finds_its_own_prefix_again(paged):
    a = TextContext(np.arange(6))
    paged.claim(a.request_id)
    for t in range(4):
        paged.fetch([a])
        a.update(100 + t)
        paged.step([a])
    pages = paged.get_req_blocks(a.request_id)
    paged.release(a.request_id)
    a.reset()  # 10 tokens of prompt now
    paged.claim(a.request_id)
    paged.alloc(a)
    assert a.start_idx == 8 and paged.get_req_blocks(a.request_id)[:2] == pages[:2]


def test_released_prefix_outlives_its_suffix(session):
    m = make_paged(session, num_pages=6, max_seq_len=16)
    a = TextContext(np.arange(13))
    m.claim(a.request_id)
    m.fetch([a])
    a.update(0)
    m.step([a])  # pages 0, 1, 2 committed, page 3 partial
    m.release(a.request_id)
    hog = TextContext(np.arange(200, 214))
    m.claim(hog.request_id)
    m.alloc(hog)  # 4 pages: the 3 free ones + the LRU's oldest, a's page 2 (its tail)
    m.release(hog.request_id)
    b = TextContext(np.arange(13))
    m.claim(b.request_id)
    m.alloc(b)
    assert b.start_idx == 8


def test_bad_input_raises_named_errors_and_changes_nothing(session, paged):
    a = TextContext(np.arange(5), request_id="a")
    paged.claim(a.request_id)
    paged.fetch([a])
    before = state(paged, [a])
    with pytest.raises(mokv.UnknownRequestError, match="'nope'"):
        paged.release(mokv.RequestID("nope"))
    with pytest.raises(mokv.UnknownRequestError):
        paged.fetch([a, TextContext([1])])
    with pytest.raises(mokv.AlreadyClaimedError, match="'a'"):
        paged.claim(a.request_id)
    with pytest.raises(mokv.InvalidReplicaError, match="replica_idx=3"):
        paged.external_claim(mokv.RequestID("b"), replica_idx=3)
    long = TextContext(np.arange(40), request_id="long")
    paged.claim(long.request_id)
    with pytest.raises(mokv.SequenceTooLongError, match="40 tokens.*max_seq_len=32"):
        paged.maybe_reserve(long)
    with pytest.raises(mokv.SequenceTooLongError, match="max_seq_len=32"):
        paged.fetch([a], num_steps=30)
    with pytest.raises(ValueError, match="num_steps"):
        paged.fetch([a], num_steps=0)
    paged.release(long.request_id)
    assert state(paged, [a]) == before
    for i in range(3):
        paged.claim(mokv.RequestID(f"x{i}"))
    with pytest.raises(mokv.BatchTooLargeError, match="max_batch_size"):
        paged.claim(mokv.RequestID("one-too-many"))


def test_bad_configuration_is_rejected(session):
    with pytest.raises(ValueError, match="page_size=16 disagrees"):
        mokv.PagedKVCacheManager(small_params(), 2, 32, NUM_LAYERS, [CPU()], session, 10**6, page_size=16)
    with pytest.raises(mokv.InsufficientMemoryError, match="needs 8"):
        make_paged(session, num_pages=7)
    with pytest.raises(ValueError, match="2 device"):
        mokv.PagedKVCacheManager(small_params(), 2, 32, NUM_LAYERS, [CPU()] * 2, session, 10**6)
    with pytest.raises(TypeError, match="max.driver.Device"):
        mokv.PagedKVCacheManager(small_params(), 2, 32, NUM_LAYERS, ["cpu"], session, 10**6)
    with pytest.raises(TypeError, match="DType"):
        small_params(dtype="float32")
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        small_params(n_kv_heads=3, n_devices=2)
    with pytest.raises(ValueError, match="swap_space_gb must be a finite number of GiB > 0, got 0"):
        mokv.HostTierConfig(swap_space_gb=0)
    with pytest.raises(ValueError, match="HostTierConfig needs enable_prefix_caching"):
        small_params(tiers=(mokv.HostTierConfig(swap_space_gb=1),), enable_prefix_caching=False)
    with pytest.raises(mokv.InsufficientMemoryError, match="swap_space_gb=1e-09 holds no page"):
        make_paged(session, tiers=(mokv.HostTierConfig(swap_space_gb=1e-9),))
    with pytest.raises(ValueError, match="prefix_hash='builtin'"):
        mokv.PagedKVCacheManager(small_params(prefix_hash="builtin"), 2, 32, NUM_LAYERS, [CPU()],
                                 session, 10**6, zmq_endpoint_base="inproc://mokv-refused")


def test_data_parallel_replicas_have_their_own_pools(session):
    m = make_paged(session, num_pages=10, data_parallel_degree=2, n_devices=2)
    assert m.num_replicas == 2 and m.num_free_blocks == 20
    a = TextContext(np.arange(9))
    m.external_claim(a.request_id, replica_idx=1)
    m.fetch([a])
    a.update(0)
    m.step([a])
    assert m.get_replica(a) == 1
    assert (m.replicas[0].pool.num_free, m.replicas[1].pool.num_free) == (10, 7)
    same_prefix = TextContext(np.arange(12))
    assert m.get_or_recommend_replica(same_prefix) == 1  # longest cached prefix wins
    other = TextContext(np.arange(50, 60))
    assert m.get_or_recommend_replica(other) == 0  # no hit anywhere: most free pages
    m.external_claim(other.request_id)  # default: the replica with the most free pages
    assert m.get_replica(other) == 0
    assert m.get_data_parallel_splits([other, a]).to_numpy().tolist() == [0, 1, 2]
    inputs = m.fetch([other, a])
    assert [i.cache_lengths.to_numpy().tolist() for i in inputs] == [[0], [9]]


def test_fetch_groups_a_mixed_batch_by_replica_as_max_does(session):
    """Issue 56: a batch whose requests alternate between replicas ([0, 1, 0]) was
    refused ("not ordered by replica"); MAX 25.7 groups it by replica, each group in
    batch order, and so does mokv."""
    m = make_paged(session, num_pages=10, data_parallel_degree=2, n_devices=2)
    ctxs = [TextContext(np.arange(n)) for n in (3, 5, 7)]
    for ctx, replica in zip(ctxs, (0, 1, 0)):
        m.external_claim(ctx.request_id, replica_idx=replica)
    inputs = m.fetch(ctxs)
    assert [i.cache_lengths.to_numpy().tolist() for i in inputs] == [[0, 0], [0]]
    assert [i.lookup_table.to_numpy().shape[0] for i in inputs] == [2, 1]
    assert m.get_data_parallel_splits(ctxs).to_numpy().tolist() == [0, 2, 3]
    for ctx in ctxs:
        ctx.update(1)
    m.step(ctxs)
    again = m.fetch(ctxs)  # the cache lengths, replica by replica, in batch order
    assert [i.cache_lengths.to_numpy().tolist() for i in again] == [[3, 7], [5]]
    m.check_invariants()


def test_tensor_parallel_splits_kv_heads_across_devices(session):
    m = make_paged(session, n_kv_heads=4, n_devices=2)
    assert m.params.n_kv_heads_per_device == 2
    ctx = TextContext(np.arange(5))
    m.claim(ctx.request_id)
    inputs = m.fetch([ctx])
    assert len(inputs) == 2
    assert [i.blocks.shape for i in inputs] == [(16, 2, NUM_LAYERS, 4, 2, 8)] * 2
    assert inputs[0].blocks is not inputs[1].blocks
    assert [i.lookup_table.to_numpy()[:, :2].tolist() for i in inputs] == [[[0, 1]]] * 2
    assert len(m.input_symbols()) == 2


def test_sizing_formulas_match_hand_computed_numbers():
    # bf16, 8 kv heads, head_dim 128, 32 layers, page 128:
    # bytes per token = 2 * 32 * 8 * 128 * 2 = 131072; per page = 16 MiB.
    p = mokv.KVCacheParams(DType.bfloat16, 8, 128, page_size=128, data_parallel_degree=2, n_devices=2)
    assert p.bytes_per_page(32) == 16 * 2**20
    memory = 10 * 2**30 + 5  # 5 GiB per replica -> 320 pages each
    cls = mokv.PagedKVCacheManager
    assert cls.max_supported_sequence_length(p, 32, memory) == 320 * 128
    assert cls.estimated_memory_size(p, 64, 4096, 32, memory, []) == 640 * 16 * 2**20
    # 4096 tokens = 32 pages per sequence -> 10 per replica -> 20 in all
    assert cls.infer_optimal_batch_size(p, 4096, 32, memory, []) == 20
    assert cls.infer_optimal_batch_size(p, 10**6, 32, memory, []) == 1


def test_occupancy_properties(session, paged):
    assert (paged.free_blocks_pct, paged.used_blocks_pct) == (1.0, 0.0)
    assert (paged.total_num_host_pages, paged.host_committed_block_pct) == (0, 0.0)
    ctx = TextContext(np.arange(16))
    paged.claim(ctx.request_id)
    paged.alloc(ctx)
    assert paged.used_blocks_pct == pytest.approx(4 / 16)
    assert paged.contains(ctx.request_id) and not paged.contains(mokv.RequestID("x"))
    m = paged.metrics
    assert (m.used_pages, m.free_pages) == (4, 12)


def test_reset_prefix_cache_forgets_cached_prefixes(paged):
    a = TextContext(np.arange(9))
    paged.claim(a.request_id)
    paged.fetch([a])
    a.update(0)
    paged.step([a])
    paged.release(a.request_id)
    paged.reset_prefix_cache()
    b = TextContext(np.arange(9))
    paged.claim(b.request_id)
    paged.alloc(b)
    assert b.start_idx == 0


def test_increment_cache_lengths_on_the_device(session, paged):
    a, b = TextContext(np.arange(3)), TextContext(np.arange(5))
    for ctx in (a, b):
        paged.claim(ctx.request_id)
    inputs = paged.fetch([a, b], num_steps=3)
    row_offsets = np.array([0, 3, 8], dtype=np.uint32)
    nxt = paged.increment_cache_lengths(inputs, row_offsets)
    assert nxt[0].cache_lengths.to_numpy().tolist() == [3, 5]
    assert nxt[0].max_lengths.to_numpy().tolist() == inputs[0].max_lengths.to_numpy()[1:].tolist()
    assert nxt[0].lookup_table is inputs[0].lookup_table

    class ModelInputs:
        input_row_offsets = Buffer.from_numpy(np.array([0, 1, 2], dtype=np.uint32))

    again = paged.increment_cache_lengths(nxt, ModelInputs())
    assert again[0].cache_lengths.to_numpy().tolist() == [4, 6]
    with pytest.raises(ValueError, match="3 entries"):
        paged.increment_cache_lengths(nxt, [row_offsets] * 3)


def test_runtime_checks_catch_corrupted_bookkeeping(paged):
    ctx = TextContext(np.arange(5))
    paged.claim(ctx.request_id)
    paged.alloc(ctx)
    paged.replicas[0].pool._ref_count[0] += 1  # simulate a bug
    with pytest.raises(mokv.InvariantError, match="page 0 .* ref count 2 but 1 owners"):
        paged.step([ctx])
