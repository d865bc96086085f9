"""The shared tier of paged managers on a real Redis Cluster (3 masters, one replica
each): two layouts on one cluster never read each other's pages; a restarted server
serves its earlier prefixes from the cluster on its first request."""

import numpy as np
from mokv import TextContext
from mokv.cache import page_copy

from .test_remote import PREFIX, flush, fresh_namespace, remote_manager, reserved, serve, stores


def test_two_layouts_on_one_cluster_never_read_each_others_pages(session, redis_cluster):
    ns = fresh_namespace()
    a = remote_manager(session, redis_cluster, ns)  # 2 KV heads of 8
    wide = dict(n_kv_heads=4, head_dim=4)  # the same bytes per page, another layout
    b = remote_manager(session, redis_cluster, ns, **wide)
    a_pages = serve(a, TextContext(np.r_[PREFIX, [9]], "A"), fill_seed=1)
    b_pages = serve(b, TextContext(np.r_[PREFIX, [9]], "B"), fill_seed=2)
    flush(a)
    flush(b)
    assert a.remote_metrics.pages_written == b.remote_metrics.pages_written == 2
    assert b.metrics.remote_cache_tokens == 0  # A's pages, written first, were not B's
    (sa,), (sb,) = stores(a), stores(b)
    hashes = a.replicas[0].committed_hashes("A")
    assert hashes == b.replicas[0].committed_hashes("B")  # the same tokens, one hash chain
    assert {sa.key(h) for h in hashes}.isdisjoint(sb.key(h) for h in hashes)
    # A's values planted under B's keys are refused, never served as B's pages.
    masters = {n.address: n for n in sa.nodes.masters()}
    for h in hashes:
        value = sa.nodes.node_of(sa.key(h)).client.get(sa.key(h))
        masters[sb.nodes.node_of(sb.key(h)).address].client.set(sb.key(h), value)
    again_a = remote_manager(session, redis_cluster, ns)
    ctx = reserved(again_a, np.r_[PREFIX, [5]], "A2")
    again_a.fetch([ctx])
    assert ctx.start_idx == 8  # A's layout: A's pages, bit for bit
    loaded = page_copy.numpy_view(again_a.replicas[0].blocks[0])[again_a.get_req_blocks("A2")]
    np.testing.assert_array_equal(loaded[:2], a_pages[0][:2])
    again_b = remote_manager(session, redis_cluster, ns, **wide)
    assert reserved(again_b, np.r_[PREFIX, [5]], "B2").start_idx == 0
    assert again_b.remote_metrics.rejected_layout == 1  # B's key, A's value: a miss
    assert not np.array_equal(a_pages[0][:2], b_pages[0][:2])
    for m in (a, b, again_a, again_b):
        m.close()


def test_a_dead_master_costs_a_manager_misses_never_an_error(session, redis_cluster):
    # A commits six prompts to the cluster; the master holding prompt 0's first page
    # dies. B asks for every prompt at once: prompt 0 misses, the others' pages come from
    # the live masters, bit for bit, and no call raises. Then the node comes back.
    ns = fresh_namespace()
    a = remote_manager(session, redis_cluster, ns, num_pages=16)
    prompts = [np.arange(8) + 100 * i for i in range(6)]  # two full pages each
    a_pages, first_pages = [], []
    for i, prompt in enumerate(prompts):
        a_pages.append(serve(a, TextContext(np.r_[prompt, [9]], f"A{i}"), fill_seed=i)[0])
        first_pages.append(a.replicas[0].committed_hashes(f"A{i}")[0])
        a.release(f"A{i}")
    flush(a)
    redis_cluster.sync_replicas()
    (store,) = stores(a)
    victim = redis_cluster.by_address(store.nodes.node_of(store.key(first_pages[0])).address)
    b = remote_manager(session, redis_cluster, ns, num_pages=16)
    victim.kill()
    try:
        hits = []
        for i, prompt in enumerate(prompts):
            ctx = reserved(b, np.r_[prompt, [5]], f"B{i}")
            b.fetch([ctx])
            n = ctx.start_idx // 4
            view = page_copy.numpy_view(b.replicas[0].blocks[0])
            np.testing.assert_array_equal(view[b.get_req_blocks(f"B{i}")[:n]], a_pages[i][:n])
            hits.append(n)
            b.release(f"B{i}")
        b.check_invariants()
        assert hits[0] == 0 and sum(hits) > 0, hits
        remote = b.remote_metrics
        assert remote.errors + remote.skipped > 0 and remote.rejected_corrupt == 0
    finally:
        victim.start()
        redis_cluster.wait_ok()
    a.close()
    b.close()
