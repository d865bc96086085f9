"""The numpy reference decoder is itself a sound ground truth."""

import mokv_graphs as mg
import numpy as np


def test_reference_is_causal(config, weights):
    """Logits at a position depend only on the tokens up to it."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, 40)
    full = mg.reference_logits(config, weights, tokens)
    prefix = mg.reference_logits(config, weights, tokens[:25])
    np.testing.assert_allclose(full[:25], prefix, rtol=1e-10, atol=1e-10)
    changed = tokens.copy()
    changed[30] = (changed[30] + 1) % config.vocab_size
    other = mg.reference_logits(config, weights, changed)
    np.testing.assert_allclose(other[:30], full[:30], rtol=1e-10, atol=1e-10)
    assert not np.allclose(other[30:], full[30:])


def test_rope_table_rotates_by_relative_position(config):
    """Rotate-half RoPE: <R(p)q, R(p')k> depends only on p - p', and norms are kept."""
    table = mg.rope_table(config).astype(np.float64)
    half = config.head_dim // 2
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal(config.head_dim), rng.standard_normal(config.head_dim)

    def rotate(x, pos):
        cos, sin = table[pos, :half], table[pos, half:]
        return np.concatenate([x[:half] * cos - x[half:] * sin, x[half:] * cos + x[:half] * sin])

    assert np.isclose(np.linalg.norm(rotate(q, 77)), np.linalg.norm(q))
    assert np.isclose(rotate(q, 10) @ rotate(k, 3), rotate(q, 107) @ rotate(k, 100))
    assert table.shape == (config.max_seq_len, config.head_dim)
    np.testing.assert_array_equal(table[0], np.r_[np.ones(half), np.zeros(half)])


def test_greedy_generation_follows_argmax(config, weights):
    prompt = np.arange(1, 12)
    out = mg.reference_generate(config, weights, prompt, 4)
    logits = mg.reference_logits(config, weights, np.r_[prompt, out[:-1]])
    np.testing.assert_array_equal(out, logits[len(prompt) - 1 :].argmax(axis=1))
