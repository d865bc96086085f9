"""Llama 3.1 RoPE scaling against its definition, written out here once more, per frequency."""

import dataclasses
import math

import mokv_graphs as mg
import numpy as np
import pytest
from mokv_graphs.rope import inverse_frequencies

SCALING = mg.Llama3RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)
"""With head_dim 16 and theta 1e4 the wavelengths run from 6 to 2e4 positions: the first
stays (< 64 / 4), two are blended, the other five are slowed down (> 64 / 1)."""


def llama3_frequency(f: float, factor: float, low: float, high: float, length: int) -> float:
    """Meta's definition: keep fast rotations, slow slow ones, blend the band in between."""
    wavelength = 2 * math.pi / f
    if wavelength < length / high:
        return f
    if wavelength > length / low:
        return f / factor
    weight_of_original = (length / wavelength - low) / (high - low)
    return (1 - weight_of_original) * f / factor + weight_of_original * f


def test_llama3_scaled_table_follows_the_definition(config):
    scaled = dataclasses.replace(config, rope_scaling=SCALING)
    d = config.head_dim
    plain = [config.rope_theta ** (-2 * i / d) for i in range(d // 2)]
    expected = [llama3_frequency(f, 8.0, 1.0, 4.0, 64) for f in plain]
    ratios = np.array(plain) / np.array(expected)
    assert ratios[0] == 1.0 and np.all(ratios[-5:] == 8.0)  # all three regimes occur
    assert np.all((ratios[1:3] > 1.0) & (ratios[1:3] < 8.0))

    table = mg.rope_table(scaled)
    pos = np.arange(config.max_seq_len)[:, None]
    np.testing.assert_allclose(table[:, : d // 2], np.cos(pos * expected), atol=1e-6)
    np.testing.assert_allclose(table[:, d // 2 :], np.sin(pos * expected), atol=1e-6)
    assert not np.allclose(table, mg.rope_table(config), atol=1e-2)


def test_llama31_frequencies():
    """Llama 3.1 8B's numbers: head_dim 128, theta 5e5, factor 8 beyond 8192 / 1 positions."""
    scaling = mg.Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    config = mg.DecoderConfig(hidden_size=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                              rope_theta=500000.0, rope_scaling=scaling, max_seq_len=4)
    inv = inverse_frequencies(128, 500000.0, scaling)
    plain = 500000.0 ** (-np.arange(64) * 2 / 128)
    for i in range(64):
        assert inv[i] == pytest.approx(llama3_frequency(plain[i], 8.0, 1.0, 4.0, 8192), rel=1e-12)
    np.testing.assert_allclose(mg.rope_table(config)[1, :64], np.cos(inv), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(factor=0.0), "factor"),
        (dict(high_freq_factor=1.0), "high_freq_factor=1.0"),
        (dict(original_max_position_embeddings=8192.0), "original_max_position_embeddings"),
    ],
)
def test_bad_scaling_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(SCALING, **kwargs)
