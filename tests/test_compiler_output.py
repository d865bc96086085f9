"""`filter_collection_warnings` filters file descriptor 2 only inside its block, and
importing or using mokv patches nothing of MAX's."""

import os

import mokv
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph
from mokv.compiler_output import drop_collection_warnings

WARNING = (
    "warning: transfer from a value of trivial register type "
    "'PagedKVCacheCollection[Int(0), Int(2), Int(64), Int(16)]' has no effect and can be removed\n"
    "    return var__9^\n"
    "                 ^\n"
    "                 \n"
)


def test_collection_warning_blocks_are_dropped_and_nothing_else():
    other = "warning: something else\n    x^\n     ^\n\n"
    text = "before\n" + WARNING + other + WARNING + "after\n"
    assert drop_collection_warnings(text) == "before\n" + other + "after\n"


def test_the_block_filters_descriptor_2_and_restores_it(capfd, monkeypatch):
    monkeypatch.delenv("MOKV_COMPILER_WARNINGS", raising=False)
    target = os.fstat(2).st_ino
    os.write(2, b"before the block\n")
    with mokv.filter_collection_warnings():
        assert os.fstat(2).st_ino != target  # a temporary file meanwhile
        os.write(2, ("kept\n" + WARNING + "also kept\n").encode())
        with mokv.filter_collection_warnings():  # nested: no second redirection
            os.write(2, WARNING.encode())
    assert os.fstat(2).st_ino == target
    os.write(2, WARNING.encode())  # outside a block nothing is filtered
    assert capfd.readouterr().err == "before the block\nkept\nalso kept\n" + WARNING


def test_show_turns_the_block_off(capfd, monkeypatch):
    monkeypatch.setenv("MOKV_COMPILER_WARNINGS", "show")
    with mokv.filter_collection_warnings():
        os.write(2, WARNING.encode())
    assert capfd.readouterr().err == WARNING


def test_building_a_graph_with_collections_patches_nothing_of_max():
    before = dict(vars(InferenceSession))
    params = mokv.KVCacheParams(DType.float32, n_kv_heads=2, head_dim=8, page_size=4)
    symbols = mokv.PAGED.input_symbols(params, 2, 16, DeviceRef.CPU())
    with Graph("collection", input_types=list(symbols)) as graph:
        mokv.FetchPagedKVCacheCollection(params, num_layers=2)(*graph.inputs)
        graph.output()
    assert dict(vars(InferenceSession)) == before
    assert not any(hasattr(getattr(InferenceSession, name), "__wrapped__")
                   for name in ("compile", "load", "load_all"))
