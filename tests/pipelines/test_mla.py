"""MAX's MLAKVCacheParams through mokv.pipelines: the same trace on MAX's own manager and
on mokv's gives the same inputs (MAX's MLA dispatch metadata and partitions included),
of the types MAX's params declare; mokv.max_kv_params gives them back. MLA children of a
MultiKVCacheParams (DeepSeek V3.2's tree, an MTP draft's, one beside a K and V cache)
too: MAX's own (Jenga) manager takes them, and so does mokv's."""

from __future__ import annotations

import dataclasses

import pytest
from max.dtype import DType
from max.graph import DeviceRef
from max.nn.kv_cache import MLAKVCacheParams, MultiKVCacheParams
from mokv import CacheGroupConfig, KVCacheParams, max_kv_params
from mokv.pipelines import UnsupportedMaxParamsError
from mokv.pipelines import load_kv_manager as mokv_loader
from mokv.pipelines.params import mokv_params

from .conftest import BASE_FIELDS, NUM_PAGES, PAGE_SIZE, loader_args, max_context, max_params
from .test_groups import loaders, trace
from .test_manager import observe, run_trace

HEAD_DIM = 64 + 16  # MAX's 64-wide RoPE key after a latent of 16


def mla_params(**fields) -> MLAKVCacheParams:
    return MLAKVCacheParams(**(BASE_FIELDS | {"head_dim": HEAD_DIM, "num_q_heads": 4} | fields))


def mla_loader_args(session, **fields) -> dict:
    params = mla_params(**fields)
    return loader_args(session) | {
        "params": params,
        "available_cache_memory": NUM_PAGES * params.bytes_per_block,
    }


@pytest.fixture
def managers(session):
    from max.pipelines.kv_cache import load_kv_manager

    pair = load_kv_manager(**mla_loader_args(session)), mokv_loader(**mla_loader_args(session))
    yield pair
    for manager in pair:
        manager.shutdown()


def test_mla_params_are_one_mla_group():
    params = mokv_params(mla_params(devices=[DeviceRef.CPU()] * 2))
    assert params.groups == (CacheGroupConfig("mla", 2, latent_dim=16, rope_dim=64),)
    assert (params.n_kv_heads, params.head_dim, params.kv_dim, params.n_devices) == (1, 80, 1, 2)
    with pytest.raises(UnsupportedMaxParamsError, match="windowed MLA cache .window_size=8"):
        mokv_params(mla_params(window_size=8))
    with pytest.raises(UnsupportedMaxParamsError, match="MLA latent of head_dim=64"):
        mokv_params(mla_params(head_dim=64))


def test_a_served_trace_reads_as_on_max_s_own_manager(managers):
    max_own, ours = managers
    assert run_trace(ours)[0] == run_trace(max_own)[0]


def test_runtime_inputs_are_max_s_mla_form_and_match_its_symbols(managers):
    max_own, ours = managers
    seen = []
    for manager in (max_own, ours):
        ctx = max_context([1, 2, 3])
        manager.claim(ctx)
        manager.alloc(ctx)
        (device,) = manager.runtime_inputs([[ctx]])
        (symbols,) = manager.params.get_symbolic_inputs()
        leaves = [
            (name, getattr(device, name), getattr(symbols, name))
            for name in (f.name for f in dataclasses.fields(symbols))
            if getattr(symbols, name) is not None
        ]
        assert [name for name, value, _ in leaves if value is None] == []
        for name, value, symbol in leaves:
            assert value.dtype == symbol.dtype, name
            assert len(value.shape) == len(symbol.shape), name
        seen.append(
            observe([device])
            + [device.mla_num_partitions.to_numpy().tolist(), sorted(n for n, _, _ in leaves)]
        )
        manager.release(ctx)
    assert seen[0] == seen[1]
    assert seen[1][0][3] == [1, 143, 1]  # batch, prompt width, one partition on the CPU


def test_max_kv_params_of_an_mla_cache_are_max_s():
    group = CacheGroupConfig("mla", 2, latent_dim=16, rope_dim=64)
    params = KVCacheParams(DType.float32, 1, HEAD_DIM, page_size=PAGE_SIZE, groups=(group,))
    theirs = max_kv_params(params, 2, [DeviceRef.CPU()], num_q_heads=4)
    assert isinstance(theirs, MLAKVCacheParams)
    assert theirs.shape_per_block == mla_params().shape_per_block == [1, 2, PAGE_SIZE, 1, 80]
    assert mokv_params(theirs) == params
    with pytest.raises(ValueError, match="num_q_heads must be a positive int, got None"):
        max_kv_params(params, 2, [DeviceRef.CPU()])


MLA_TREES = {
    # DeepSeek V3.2: the latent, and its indexer's keys (one 128-wide row per token)
    "v3.2": {"mla": mla_params(), "indexer": mla_params(head_dim=128)},
    # a multi-token-prediction draft: the target's latent and the draft layer's
    "mtp": {"target": mla_params(), "draft": mla_params(num_layers=1)},
    "beside k and v": {"mla": mla_params(), "full_attention": max_params(num_layers=1)},
}


@pytest.mark.parametrize("name", list(MLA_TREES))
def test_a_tree_of_mla_children_reads_as_on_max_s_own_manager(session, name):
    params = MultiKVCacheParams.from_params(MLA_TREES[name])
    ours = mokv_params(params)
    assert [(g.name, g.kind) for g in ours.groups] == [
        (key, "mla" if type(child) is MLAKVCacheParams else "full")
        for key, child in MLA_TREES[name].items()
    ]
    theirs, mine = loaders(session, params, pages=200)
    assert trace(mine) == trace(theirs)
    for manager in (theirs, mine):
        manager.shutdown()


def test_a_tree_on_two_devices_keeps_each_latent_whole():
    """Tensor parallelism splits a K and V child's heads; an MLA child's latent is whole on
    each device (counted once per device), and needs no heads to split."""
    two = {"devices": [DeviceRef.CPU()] * 2}
    params = mokv_params(MultiKVCacheParams.from_params(
        {"mla": mla_params(**two), "full_attention": max_params(num_layers=1, **two)}
    ))
    mla, full = (params.group_params(g) for g in params.groups)
    assert (mla.n_kv_heads_per_device, full.n_kv_heads_per_device) == (1, 1)
    assert mla.bytes_per_token(2) == 2 * HEAD_DIM * 4 * 2  # layers * row * float32 * devices
