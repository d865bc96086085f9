"""Hugging Face checkpoint directories: config.json in both transformers styles, sharded
safetensors, and refusal (naming the key or tensor) of what the decoder cannot honour."""

import dataclasses
import json

import mokv
import mokv_graphs as mg
import numpy as np
import pytest

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def hf_config(config, **overrides):
    """The config.json transformers 4 writes for `config` (a LlamaForCausalLM)."""
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": None, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }
    return hf | overrides


def write_checkpoint(directory, hf, weights, num_shards=1):
    """config.json plus model.safetensors, or `num_shards` shards and their index."""
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    if num_shards == 1:
        mg.save_safetensors(directory / "model.safetensors", weights)
        return
    weight_map = {}
    names = sorted(weights)
    for k in range(num_shards):
        shard = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[k::num_shards]
        mg.save_safetensors(directory / shard, {n: weights[n] for n in part})
        weight_map |= dict.fromkeys(part, shard)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_transformers4_and_5_configs(config):
    expected = dataclasses.replace(
        config, rope_theta=500000.0, rope_scaling=mg.Llama3RopeScaling(**LLAMA3)
    )
    t4 = hf_config(config, rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3})
    t5 = {k: v for k, v in t4.items() if k not in ("rope_theta", "rope_scaling")}
    t5["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}
    assert mg.config_from_hf(t4) == expected
    assert mg.config_from_hf(t5) == expected
    default = t5 | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert mg.config_from_hf(default) == dataclasses.replace(config, rope_theta=1e6)


def test_optional_keys_take_llama_defaults(tmp_path, config):
    hf = hf_config(config)
    for key in ("num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling"):
        del hf[key]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    parsed = mg.config_from_hf(tmp_path)  # a directory, or the file itself
    assert parsed == mg.config_from_hf(tmp_path / "config.json")
    assert parsed.n_kv_heads == config.n_heads
    assert parsed.head_dim == config.hidden_size // config.n_heads
    assert (parsed.rms_norm_eps, parsed.rope_theta, parsed.rope_scaling) == (1e-6, 10000.0, None)
    mistral = hf_config(config, model_type="mistral", sliding_window=None)
    assert mg.config_from_hf(mistral) == config


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "'dynamic'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"rope_scaling": {"factor": 8.0}}, "rope_scaling has keys .*'factor'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "'gelu'"),
        ({"model_type": "qwen2"}, "'qwen2'"),
        ({"model_type": "gemma"}, "'gemma'"),
        ({"model_type": "mistral", "sliding_window": 128}, "sliding_window=128"),
    ],
)
def test_unsupported_config_is_named(config, overrides, match):
    with pytest.raises(ValueError, match=match):
        mg.config_from_hf(hf_config(config, **overrides))


@pytest.mark.parametrize("num_shards", [1, 3])
def test_load_checkpoint(tmp_path, config, weights, num_shards):
    inv_freq = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}
    write_checkpoint(tmp_path / "ckpt", hf_config(config), weights | inv_freq, num_shards)
    loaded_config, loaded = mg.load_checkpoint(tmp_path / "ckpt")
    assert loaded_config == config
    assert loaded.keys() == weights.keys() | inv_freq.keys()  # the RoPE buffer is left unused
    for name in weights:
        np.testing.assert_array_equal(loaded[name], weights[name], err_msg=name)


def test_tied_embeddings(tmp_path, config, weights):
    untied = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    write_checkpoint(tmp_path / "tied", hf_config(config, tie_word_embeddings=True), untied, 2)
    _, loaded = mg.load_checkpoint(tmp_path / "tied")
    np.testing.assert_array_equal(loaded["lm_head.weight"], weights["model.embed_tokens.weight"])

    write_checkpoint(tmp_path / "untied", hf_config(config), untied)
    with pytest.raises(ValueError, match="lm_head.weight"):
        mg.load_checkpoint(tmp_path / "untied")
    write_checkpoint(tmp_path / "both", hf_config(config, tie_word_embeddings=True), weights)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        mg.load_checkpoint(tmp_path / "both")


def test_bias_and_other_unused_tensors_are_named(tmp_path, config, weights):
    """A Qwen2-style file mislabelled as Llama would otherwise lose its biases silently."""
    biases = {f"model.layers.{i}.self_attn.{x}_proj.bias": np.ones(16, np.float32)
              for i in range(2) for x in "qkv"}
    write_checkpoint(tmp_path / "bias", hf_config(config), weights | biases, 2)
    with pytest.raises(ValueError, match=r"6 checkpoint .*'model.layers.0.self_attn.k_proj.bias'"):
        mg.load_checkpoint(tmp_path / "bias")
    mg.save_safetensors(tmp_path / "bias.safetensors", weights | biases)
    with pytest.raises(ValueError, match="model.layers.1.self_attn.v_proj.bias"):
        mg.load_safetensors(tmp_path / "bias.safetensors", config)
    extra_layer = {"model.layers.2.mlp.up_proj.weight": weights["model.norm.weight"]}
    with pytest.raises(ValueError, match="model.layers.2.mlp.up_proj.weight"):
        mg.graph_weights(config, weights | extra_layer)


def test_missing_files_and_tensors_are_named(tmp_path, config, weights):
    write_checkpoint(tmp_path / "sharded", hf_config(config), weights, 3)
    (tmp_path / "sharded" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        mg.load_checkpoint(tmp_path / "sharded")

    write_checkpoint(tmp_path / "short", hf_config(config), weights, 2)
    index_path = tmp_path / "short" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    absent = "model.layers.0.self_attn.q_norm.weight"
    index["weight_map"][absent] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_norm.weight"):
        mg.load_checkpoint(tmp_path / "short")

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(hf_config(config)))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        mg.load_checkpoint(tmp_path / "empty")


def test_llama3_checkpoint_decodes_like_the_reference(tmp_path, config, weights, session,
                                                       make_kv_manager):
    """The two-line load, then cached decoding with scaled RoPE equals the numpy decoder.

    Only the RoPE table (a weight) differs from the shared models' graph, so the
    compiled graph is reused from the cache.
    """
    hf = hf_config(config, rope_scaling={"rope_type": "llama3", **LLAMA3})
    write_checkpoint(tmp_path / "ckpt", hf, weights, 2)
    scaled, loaded = mg.load_checkpoint(tmp_path / "ckpt")
    manager = make_kv_manager("paged")
    model = mg.DecoderModel(scaled, manager, session, loaded)

    ctx = mokv.TextContext(np.random.default_rng(0).integers(0, config.vocab_size, 30))
    manager.external_claim(ctx.request_id)
    for _ in range(6):  # a prefill, then decode steps at positions 30..34
        assert manager.maybe_reserve(ctx)
        (row,) = model.step([ctx])
        ref = mg.reference_logits(scaled, weights, ctx.tokens[: ctx.active_idx])[-1]
        np.testing.assert_allclose(row, ref, atol=2e-4, rtol=0)
        unscaled = mg.reference_logits(config, weights, ctx.tokens[: ctx.active_idx])[-1]
        assert np.abs(unscaled - ref).max() > 1e-2  # the scaling shows in the logits
        ctx.update(int(np.argmax(row)))
        manager.step([ctx])
    manager.release(ctx.request_id)


@pytest.mark.parametrize("scaling", [None, mg.Llama3RopeScaling(**LLAMA3)])
def test_save_checkpoint_writes_what_load_checkpoint_and_a_tokenizer_read(
    tmp_path, config, weights, scaling
):
    from tokenizers import Tokenizer

    config = dataclasses.replace(config, rope_scaling=scaling)
    mg.save_checkpoint(tmp_path, config, weights)
    loaded_config, loaded = mg.load_checkpoint(tmp_path)
    assert loaded_config == config
    assert loaded.keys() == weights.keys()
    for name, array in weights.items():
        np.testing.assert_array_equal(loaded[name], array)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.encode("t1 t17 t42").ids == [1, 17, 42]
    assert tokenizer.decode([1, 17, 42]) == "t1 t17 t42"


def test_the_tiny_llama_is_written_once(tmp_path):
    directory = mg.tiny_llama_checkpoint(tmp_path)
    written = (directory / "model.safetensors").stat().st_mtime_ns
    assert mg.tiny_llama_checkpoint(tmp_path) == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == written
    assert mg.config_from_hf(directory) == mg.TINY_LLAMA


def test_a_bfloat16_checkpoint_holds_the_nearest_bfloat16_values(tmp_path, config, weights):
    weights = dict(weights)
    # 1 + 2^-8 lies halfway between two bfloat16 values: ties go to the even one, 1.0;
    # 1 + 2^-8 + 2^-9 lies above halfway: 1 + 2^-7.
    weights["model.norm.weight"] = np.full(config.hidden_size, 1.0, np.float32)
    weights["model.norm.weight"][:3] = [1 + 2**-8, 1 + 2**-8 + 2**-9, -2.5]
    mg.save_checkpoint(tmp_path, config, weights, dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, loaded = mg.load_checkpoint(tmp_path)
    np.testing.assert_array_equal(loaded["model.norm.weight"][:4], [1.0, 1 + 2**-7, -2.5, 1.0])
    for name, array in weights.items():  # every value within bfloat16's rounding
        np.testing.assert_allclose(loaded[name], array, rtol=2**-8, atol=0, err_msg=name)
