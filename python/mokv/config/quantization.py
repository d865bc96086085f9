"""KVCacheQuantization: the format of quantized KV pages (`KVCacheParams.quantization`).

mokv's quantized format is MAX 26.7's (`max.nn.kv_cache.KVCacheQuantizationConfig`,
`--kv-cache-format float8_e4m3fn`): the pages hold float8_e4m3fn values, and a second
buffer beside them, the scales, holds one float32 scale per token, per head, per
`granularity` lanes of the head (granularity 128 along the head dimension):

    values  float8_e4m3fn [pages, 2, layers, page_size, kv_heads, head_dim]
    scales  float32       [pages, 2, layers, page_size, kv_heads, head_dim // granularity]

A value `x` is stored as `q = e4m3fn(x / s)` with `s = absmax(block) / 448` (448 is
e4m3fn's largest finite value), and read back as `q * s`. The scales use the values'
page ids, so one page id names both.

A second, unscaled format is stored too: float8_e4m3fn values without a
`KVCacheQuantization` (no scales leaf), which is what MAX 26.7's Llama pipeline builds
for `--kv-cache-format float8_e4m3fn` (its `construct_kv_params` passes no
`kvcache_quant_config`; MAX's kernels cast each value, saturated, on store and read).
Its pages are a format of their own: their hashes are keyed apart from scaled FP8 and
from unquantized pages (`KVCacheParams.page_format`).

What MAX's config allows beyond these is refused by name rather than stored
differently: int8 values, float8_e4m3fnuz values, NVFP4 (`uint8` values with e4m3
scales), float16 or float8_e8m0fnu scales.
"""

from __future__ import annotations

from dataclasses import dataclass

from max.dtype import DType

QUANTIZED_DTYPES = (DType.float8_e4m3fn,)
"""Value dtypes of quantized pages that mokv stores, with a `KVCacheQuantization` (scaled)
or without (MAX's unscaled format)."""

REFUSED_QUANTIZED_DTYPES = {
    DType.float8_e4m3fnuz: "float8_e4m3fnuz values (AMD's FP8)",
    DType.int8: "int8 values",
    DType.uint8: "NVFP4 pages (uint8 values, two E2M1 per byte)",
}
"""MAX's other quantized value dtypes, each with what it is, for the refusal."""

SCALE_DTYPES = (DType.float32,)
"""Scale dtypes mokv stores (MAX also has float16 and float8_e8m0fnu scales)."""

FP8_E4M3FN_MAX = 448.0
"""The largest finite float8_e4m3fn value: a block's absmax is scaled onto it."""


@dataclass(frozen=True)
class KVCacheQuantization:
    """How quantized pages are scaled (see the module docstring).

    Attributes:
        scale_dtype: element type of the scales (float32, MAX's default).
        granularity: lanes of a head that share one scale (MAX's
            `quantization_granularity`, 128); it must divide the head size.
    """

    scale_dtype: DType = DType.float32
    granularity: int = 128

    def __post_init__(self) -> None:
        if self.granularity.__class__ is not int or self.granularity < 1:
            raise ValueError(
                f"KVCacheQuantization.granularity must be a positive int, got {self.granularity!r}"
            )
        if self.scale_dtype not in SCALE_DTYPES:
            stored = [d.name for d in SCALE_DTYPES]
            raise ValueError(
                f"KVCacheQuantization.scale_dtype={self.scale_dtype!r} is not stored by "
                f"mokv; use one of {stored}"
            )

    def scales_per_head(self, head_dim: int) -> int:
        """Scales of one token's head: `head_dim // granularity` (ValueError when the
        granularity does not divide `head_dim`, as MAX refuses it)."""
        if head_dim % self.granularity:
            raise ValueError(
                f"head_dim={head_dim} is not a multiple of the quantization "
                f"granularity={self.granularity}"
            )
        return head_dim // self.granularity


def refuse_other_formats(dtype: DType) -> None:
    """ValueError naming one of MAX's quantized formats that mokv does not store
    (`REFUSED_QUANTIZED_DTYPES`); nothing for any other dtype."""
    if dtype in REFUSED_QUANTIZED_DTYPES:
        raise ValueError(
            f"dtype={dtype} is not a supported cache dtype: mokv does not store "
            f"{REFUSED_QUANTIZED_DTYPES[dtype]}; quantized pages are "
            f"{[d.name for d in QUANTIZED_DTYPES]}"
        )


def check_format(dtype: DType, quantization: KVCacheQuantization | None, head_dim: int) -> None:
    """TypeError / ValueError naming what is wrong with a cache of `dtype` values (a
    dtype mokv stores) and `quantization` scales over heads of `head_dim`: scales that
    do not divide the head, or a quantization of a dtype that is not quantized. A
    quantized dtype without scales is MAX's unscaled format (module docstring)."""
    if quantization is not None and not isinstance(quantization, KVCacheQuantization):
        raise TypeError(
            f"quantization must be a mokv.KVCacheQuantization or None, got {quantization!r}"
        )
    if quantization is None:
        return
    if dtype in QUANTIZED_DTYPES:
        quantization.scales_per_head(head_dim)
    else:
        raise ValueError(
            f"quantization={quantization!r} is for quantized pages "
            f"({[d.name for d in QUANTIZED_DTYPES]}), but dtype={dtype}"
        )
