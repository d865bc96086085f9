"""The Mojo manager's Python binding refuses what the Python manager refuses (issue 41):
both managers, in the same state, get the same bad inputs and must raise the same error
type with the same message (naming the value), and change nothing."""

from __future__ import annotations

from typing import Any

import mokv
import pytest
from max.driver import CPU
from max.engine import InferenceSession

from .conftest import NUM_LAYERS, small_params

MAX_BATCH = 3
MAX_SEQ = 24


@pytest.fixture(scope="module")
def managers():
    """Both managers, each holding sequence 0 (20 tokens) and sequence 1 (empty); slot 2
    is free. Every test leaves them so."""
    args = (small_params(cache_strategy="continuous"), MAX_BATCH, MAX_SEQ, NUM_LAYERS, [CPU()],
            InferenceSession(devices=[CPU()]))
    pair = mokv.ContinuousBatchingKVCacheManager(*args), mokv.MojoContinuousBatchingKVCacheManager(*args)
    for m in pair:
        assert m.claim(2) == [0, 1]
        m.step({0: 20})
    return pair


def _state(m: Any) -> tuple:
    claimed = [s for s in range(MAX_BATCH) if m.contains(s)]
    return tuple(claimed), tuple(m.cache_length(s) for s in claimed), m.num_free_blocks


BAD_CALLS = [
    ("release", (1.0,)), ("release", (True,)), ("release", (None,)),
    ("release", (2**64,)), ("release", (-1,)), ("release", (2,)), ("release", (MAX_BATCH,)),
    ("cache_length", (0.0,)), ("cache_length", (2**70,)), ("cache_length", (2,)),
    ("fetch", ([0.0],)), ("fetch", (["a"],)), ("fetch", ([True],)), ("fetch", ([2**64],)),
    ("fetch", ([0, 0],)), ("fetch", ([0, 1, 1, 2],)), ("fetch", ([1], 0)),
    ("fetch", ([1], 1.0)), ("fetch", ([1], MAX_SEQ + 1)), ("fetch", ([0], 5)),
    ("fetch", ([1, 2],)),
    ("step", ({0: 1.5},)), ("step", ({0: True},)), ("step", ({0: -1},)),
    ("step", ({0: 2**63},)), ("step", ({0: 2**70},)), ("step", ({0: 5},)),
    ("step", ({1.0: 1},)), ("step", ({2**64: 1},)), ("step", ({2: 1},)), ("step", ([0],)),
    ("step", ((0, 1),)), ("step", ({1: 1, 0: "a"},)), ("step", ({1: -2, 2: 1},)),
    ("claim", (0,)), ("claim", (-1,)), ("claim", (1.0,)), ("claim", (True,)),
    ("claim", (2,)), ("claim", (2**64,)),
]


def _outcome(m: Any, name: str, args: tuple) -> tuple[str, str]:
    try:
        getattr(m, name)(*args)
    except Exception as exc:  # noqa: BLE001 - the type and the message are compared
        return type(exc).__name__, str(exc)
    return "accepted", ""


@pytest.mark.parametrize("name,args", BAD_CALLS, ids=lambda v: repr(v))
def test_both_managers_refuse_alike(managers, name, args):
    py, mj = managers
    before = _state(py)
    assert _state(mj) == before
    refused = _outcome(py, name, args)
    assert refused[0] != "accepted", f"the Python manager accepted {name}{args}"
    assert _outcome(mj, name, args) == refused
    assert _state(py) == _state(mj) == before


def test_a_str_is_a_request_id_to_the_python_manager_only(managers):
    """The Python manager answers the request contract too (`load_kv_manager` returns it
    for the continuous strategy): a str is a request id there, an error to the Mojo one."""
    py, mj = managers
    before = _state(py)
    with pytest.raises(mokv.UnknownRequestError, match="'a'"):
        py.release("a")
    py.claim("r")
    assert py.contains("r") and py.num_free_blocks == 0
    py.release("r")
    for name in ("release", "claim"):
        with pytest.raises((TypeError, ValueError), match="'a'"):
            getattr(mj, name)("a")
    assert _state(py) == _state(mj) == before


@pytest.mark.parametrize("value", [1.0, True, "a", 2**70, -1, None])
def test_contains_is_false_for_anything_but_a_claimed_id(managers, value):
    for m in managers:
        assert m.contains(value) is False


def test_the_messages_name_the_value(managers):
    py, _ = managers
    for name, args, match in [
        ("release", (1.0,), "float 1.0"), ("release", (True,), "bool True"),
        ("fetch", ([0.0],), "float 0.0"), ("step", ({0: 1.5},), "wrote 1.5 tokens"),
        ("step", ({0: 2**63},), f"sequence 0 holds 20 tokens: {2**63} new tokens"),
        ("fetch", ([0], 5), "sequence 0 holds 20 tokens: 5 more step"),
        ("step", ([0],), "mapping .*list \\[0\\]"), ("release", (2**64,), str(2**64)),
    ]:
        with pytest.raises(Exception, match=match):
            getattr(py, name)(*args)
