"""Checkpoint handling: deterministic init, safetensors round trip, the graph's layout."""

import json
import struct

import mokv_graphs as mg
import numpy as np
import pytest


def test_init_is_deterministic_and_seeded(config):
    a, b = mg.init_weights(config, seed=3), mg.init_weights(config, seed=3)
    c = mg.init_weights(config, seed=4)
    assert a.keys() == b.keys() == set(mg.checkpoint_shapes(config))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["lm_head.weight"], c["lm_head.weight"])
    assert all(w.dtype == np.float32 for w in a.values())


def test_safetensors_round_trip(tmp_path, config, weights):
    path = tmp_path / "model.safetensors"
    mg.save_safetensors(path, weights)
    loaded = mg.load_safetensors(path, config)
    assert loaded.keys() == weights.keys()
    for name in weights:
        np.testing.assert_array_equal(loaded[name], weights[name], err_msg=name)


def test_bfloat16_checkpoint_with_tied_embeddings(tmp_path, config, weights):
    """Real checkpoints are often bf16 and may tie the LM head to the embedding."""
    tensors = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    header, blobs, offset = {}, [], 0
    for name, arr in sorted(tensors.items()):
        bits = (arr.view(np.uint32) >> 16).astype("<u2")  # truncate float32 to bf16
        header[name] = {"dtype": "BF16", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + bits.nbytes]}
        blobs.append(bits.tobytes())
        offset += bits.nbytes
    head = json.dumps(header).encode()
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))

    loaded = mg.load_safetensors(path, config)
    emb = weights["model.embed_tokens.weight"]
    np.testing.assert_allclose(loaded["model.embed_tokens.weight"], emb, rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])


def test_missing_or_misshapen_weight_is_named(config, weights):
    broken = dict(weights)
    del broken["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        mg.check_weights(config, broken)
    broken = dict(weights, **{"model.norm.weight": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(3,\)"):
        mg.graph_weights(config, broken)


def test_graph_layout(config, weights):
    g = mg.graph_weights(config, weights)
    c = config
    wqkv = g["layers.0.wqkv"]
    assert wqkv.shape == (c.q_size + 2 * c.kv_size, c.hidden_size)
    np.testing.assert_array_equal(wqkv[c.q_size : c.q_size + c.kv_size],
                                  weights["model.layers.0.self_attn.k_proj.weight"])
    gate_up = g["layers.1.w_gate_up"]
    assert gate_up.shape == (c.hidden_size, 2 * c.intermediate_size)
    np.testing.assert_array_equal(gate_up[:, c.intermediate_size :],
                                  weights["model.layers.1.mlp.up_proj.weight"].T)
    assert g["lm_head"].shape == (c.hidden_size, c.vocab_size)
    assert all(w.flags.c_contiguous for w in g.values())
