"""The manager contract: every manager implements it, and takes only string request ids.
(Sequence ids are another class's: test_sequences.py.)"""

import mokv
import numpy as np
import pytest
from max.driver import CPU
from mokv import TextContext

from .conftest import NUM_LAYERS, make_paged, small_params


@pytest.fixture
def managers(session):
    cont_params = small_params(cache_strategy="continuous")
    return {
        "paged": make_paged(session),
        "continuous": mokv.ContinuousKVCacheManager(
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
    for name, manager in managers.items():
        with pytest.raises(TypeError, match="request_id must be a str.*int 7"):
            manager.external_claim(7)
        if name == "null":  # seed 001: releasing what it never saw does nothing
            manager.release(mokv.RequestID("never-claimed"))
            continue
        with pytest.raises(mokv.UnknownRequestError):
            manager.release(mokv.RequestID("never-claimed"))
