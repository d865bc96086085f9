"""RoPE frequencies: Llama's `theta ** (-2i / d)`, optionally rescaled the Llama 3.1 way.

Llama 3.1 was trained at 8k positions and then extended to 128k by slowing down only
its low-frequency (long-wavelength) rotations, which are the ones that never completed
a turn within the original context. Fast rotations, which the model had seen wrap
around many times, are kept as they are, and the band between the two is blended
linearly, so the spectrum has no jump. Checkpoints call this `rope_type: "llama3"`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Llama3RopeScaling:
    """The `"llama3"` RoPE scaling of a checkpoint's `rope_scaling` / `rope_parameters`.

    Wavelengths are `2 * pi / f_i` in positions. With `L = original_max_position_embeddings`:

        wavelength < L / high_freq_factor   f_i kept             (high frequencies)
        wavelength > L / low_freq_factor    f_i / factor         (low frequencies)
        in between                          (1 - s) * f_i / factor + s * f_i,
                                            s = (L / wavelength - low_freq_factor)
                                                / (high_freq_factor - low_freq_factor)

    `s` runs from 0 at the low-frequency edge to 1 at the high-frequency edge.

    Attributes:
        factor: how much slower the low frequencies turn (Llama 3.1: 8).
        low_freq_factor: wavelengths over `L / low_freq_factor` are fully slowed (1).
        high_freq_factor: wavelengths under `L / high_freq_factor` are kept (4).
        original_max_position_embeddings: `L`, the context length of pre-training (8192).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(
                    f"llama3 rope scaling: {name} must be a positive number, got {value!r}"
                )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"llama3 rope scaling: high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )
        length = self.original_max_position_embeddings
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(
                "llama3 rope scaling: original_max_position_embeddings must be a positive int, "
                f"got {length!r}"
            )

    def apply(self, inv_freq: np.ndarray) -> np.ndarray:
        """The scaled inverse frequencies (float64, same shape) of unscaled `inv_freq`."""
        inv_freq = np.asarray(inv_freq, dtype=np.float64)
        length = self.original_max_position_embeddings
        wavelength = 2 * np.pi / inv_freq
        smooth = (length / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        return np.where(
            wavelength < length / self.high_freq_factor,
            inv_freq,
            np.where(wavelength > length / self.low_freq_factor, inv_freq / self.factor, blended),
        )


def inverse_frequencies(
    head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None
) -> np.ndarray:
    """float64 `[head_dim / 2]`: `f_i = theta ** (-2i / head_dim)`, then `scaling` if any."""
    inv_freq = theta ** (-np.arange(0, head_dim // 2, dtype=np.float64) * 2 / head_dim)
    return inv_freq if scaling is None else scaling.apply(inv_freq)
