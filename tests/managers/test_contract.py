"""The manager contract: every manager implements it, and request ids and sequence ids
never reach each other's slots."""

import numpy as np
import pytest
from max.driver import CPU

import mokv
from mokv import TextContext

from .conftest import NUM_LAYERS, make_paged, small_params


@pytest.fixture
def managers(session):
    cont_params = small_params(cache_strategy="continuous")
    return {
        "paged": make_paged(session),
        "continuous": mokv.ContinuousBatchingKVCacheManager(
            cont_params, 3, 16, NUM_LAYERS, [CPU()], session
        ),
        "null": mokv.NullKVCacheManager(small_params(), 4, 32, NUM_LAYERS, [CPU()], session, 0),
    }


def test_every_manager_implements_the_contract(managers):
    for name, manager in managers.items():
        assert isinstance(manager, mokv.KVCacheManager), name
        assert manager.layout is (mokv.CONTINUOUS if name == "continuous" else mokv.PAGED)
        ctx = TextContext(np.arange(6))
        manager.external_claim(ctx.request_id)
        assert manager.contains(ctx.request_id) and manager.maybe_reserve(ctx)
        (inputs,) = manager.fetch([ctx])
        assert isinstance(inputs, manager.layout.Inputs)
        (symbols,) = manager.input_symbols()
        assert isinstance(symbols, manager.layout.Inputs)
        assert [s.dtype for s in symbols] == [b.dtype for b in inputs]
        assert mokv.layout_of_inputs(symbols) is manager.layout
        ctx.update(1)
        manager.step([ctx])
        manager.release(ctx.request_id)
        assert not manager.contains(ctx.request_id)


def test_request_ids_are_strings(managers):
    for manager in managers.values():
        with pytest.raises(TypeError, match="request_id must be a str.*int 7"):
            manager.external_claim(7)
        with pytest.raises(mokv.UnknownRequestError):
            manager.release(mokv.RequestID("never-claimed"))


def test_sequence_ids_and_request_ids_never_mix(managers):
    cont = managers["continuous"]
    ctx = TextContext(np.arange(4))
    cont.external_claim(ctx.request_id)
    (seq_id,) = cont.claim(1)
    assert cont.contains(seq_id) and cont.contains(ctx.request_id)
    assert not cont.contains(2)  # the free slot is no sequence
    with pytest.raises(TypeError, match="either sequence ids"):
        cont.fetch([ctx, seq_id])
    with pytest.raises(mokv.UnknownRequestError):
        cont.release(cont.get_req_blocks(ctx.request_id)[0])  # the request's slot index
    with pytest.raises(ValueError, match="positive number"):
        cont.claim(0)
    with pytest.raises(ValueError, match="a token count"):
        cont.step({seq_id: -5})
    with pytest.raises(ValueError, match="twice"):
        cont.fetch([seq_id, seq_id])
    cont.release(seq_id)
    cont.release(ctx.request_id)
    assert cont.num_free_blocks == 3


@pytest.mark.parametrize("strategy", ["paged", "continuous"])
def test_null_manager_has_the_requested_layout(session, strategy):
    params = small_params(cache_strategy=strategy, n_devices=2, n_kv_heads=4)
    null = mokv.NullKVCacheManager(params, 4, 32, NUM_LAYERS, [CPU()] * 2, session, 0)
    layout = mokv.layout_for(strategy)
    assert null.layout is layout
    expected = [layout.input_symbols(params, NUM_LAYERS, 32, s.blocks.device)
                for s in null.input_symbols()]
    assert null.input_symbols() == expected and len(expected) == 2
    ctx = TextContext(np.arange(5))
    with pytest.raises(mokv.UnknownRequestError):
        null.fetch([ctx])
    null.external_claim(ctx.request_id)
    with pytest.raises(mokv.AlreadyClaimedError):
        null.external_claim(ctx.request_id)
    inputs = null.fetch([ctx], num_steps=2)
    assert len(inputs) == 2  # one tuple per device, as many as input symbols
    for device_inputs, symbols in zip(inputs, null.input_symbols()):
        assert isinstance(device_inputs, layout.Inputs)
        assert [b.dtype for b in device_inputs] == [s.dtype for s in symbols]
        assert [len(b.shape) for b in device_inputs] == [s.rank for s in symbols]
        assert device_inputs.blocks.shape[0] == 0
    splits = null.get_data_parallel_splits([ctx])
    assert splits.to_numpy().tolist() == [0, 1]  # a Buffer, as the real managers return
