"""The format of FP8 pages (mokv/config/quantization.py, issue 53): `KVCacheParams`
takes float8_e4m3fn values with `KVCacheQuantization` scales, or without (MAX's unscaled
format), sized as MAX 26.7 sizes the same cache, and refuses by name every other
quantized format MAX knows; every manager allocates the scales leaf beside the values
and hands it out in its inputs (the Mojo manager refuses FP8 by dtype)."""

from __future__ import annotations

import mokv
import pytest
from max.driver import CPU
from max.dtype import DType
from max.graph import DeviceRef, Graph
from mokv.config.quantization import KVCacheQuantization
from mokv.layouts import DTYPE_CODES

FP8 = dict(dtype=DType.float8_e4m3fn, quantization=KVCacheQuantization())


def params(**overrides) -> mokv.KVCacheParams:
    return mokv.KVCacheParams(**{"n_kv_heads": 2, "head_dim": 256, "page_size": 16, **overrides})


@pytest.mark.parametrize(
    "fields,error,match",
    [
        (
            dict(
                dtype=DType.float8_e4m3fn,
                head_dim=576,
                n_kv_heads=1,
                groups=(mokv.CacheGroupConfig("mla", 2, latent_dim=512, rope_dim=64),),
            ),
            ValueError,
            "does not store FP8 MLA latents",
        ),
        (dict(dtype=DType.int8), ValueError, "does not store int8 values"),
        (dict(dtype=DType.uint8, quantization=KVCacheQuantization()), ValueError, "NVFP4"),
        (
            dict(dtype=DType.float8_e4m3fnuz, quantization=KVCacheQuantization()),
            ValueError,
            "float8_e4m3fnuz",
        ),
        (
            dict(dtype=DType.bfloat16, quantization=KVCacheQuantization()),
            ValueError,
            "is for quantized pages.*dtype=DType.bfloat16",
        ),
        (dict(FP8, head_dim=64), ValueError, "head_dim=64 is not a multiple of.*granularity=128"),
        (
            dict(FP8, quantization="fp8"),
            TypeError,
            "quantization must be a mokv.KVCacheQuantization",
        ),
        (
            dict(FP8, groups=(mokv.CacheGroupConfig("full_attention", 2, head_dim=192),)),
            ValueError,
            "head_dim=192 is not a multiple",
        ),
    ],
)
def test_params_refuse_formats_they_do_not_store(fields, error, match):
    with pytest.raises(error, match=match):
        params(**fields)


@pytest.mark.parametrize("scale_dtype", [DType.float16, DType.float8_e8m0fnu])
def test_only_float32_scales_are_stored(scale_dtype):
    with pytest.raises(ValueError, match=f"scale_dtype={scale_dtype.name}"):
        KVCacheQuantization(scale_dtype=scale_dtype)


@pytest.mark.parametrize("granularity", [0, -128, 1.5, True])
def test_granularity_is_a_positive_int(granularity):
    with pytest.raises(ValueError, match="granularity must be a positive int"):
        KVCacheQuantization(granularity=granularity)


@pytest.mark.parametrize(
    "fields",
    [
        FP8,
        dict(dtype=DType.bfloat16),
        dict(dtype=DType.float8_e4m3fn),
        dict(FP8, quantization=KVCacheQuantization(granularity=64)),
    ],
)
@pytest.mark.parametrize("tp", [1, 2])
def test_a_page_is_as_many_bytes_as_max_sizes_it(fields, tp):
    # MAX's own params of the same cache (`max_kv_params`) are the reference: values and
    # scales together, `bytes_per_block`.
    p = params(**fields, n_devices=tp, page_size=128)
    devices = [DeviceRef.CPU()] * tp
    theirs = mokv.max_kv_params(p, num_layers=3, devices=devices)
    assert theirs.quantized_kv_cache == (p.quantization is not None)
    assert p.bytes_per_page(3) == theirs.bytes_per_block


def test_max_params_of_fp8_pages_have_one_scale_per_token_head_and_128_lanes():
    theirs = mokv.max_kv_params(params(**FP8), num_layers=3, devices=[DeviceRef.CPU()])
    assert theirs.kvcache_quant_config.scale_dtype == DType.float32
    assert theirs.kvcache_quant_config.quantization_granularity == 128
    assert theirs.shape_per_scale_block == [2, 3, 16, 2, 2]


def test_fp8_pages_are_half_of_bfloat16_pages_and_their_scales():
    # 1 byte a value and 4 bytes per 128 values, against 2 bytes a value.
    fp8, bf16 = params(**FP8).bytes_per_page(4), params(dtype=DType.bfloat16).bytes_per_page(4)
    assert fp8 / bf16 == (1 + 4 / 128) / 2


def test_unscaled_fp8_pages_are_a_format_of_their_own():
    unscaled, scaled = params(dtype=DType.float8_e4m3fn), params(**FP8)
    assert unscaled.page_format == "float8_e4m3fn" != scaled.page_format
    assert params(dtype=DType.bfloat16).page_format == ""
    assert unscaled.bytes_per_page(4) * 2 == params(dtype=DType.bfloat16).bytes_per_page(4)
    assert unscaled.scales_shape([3, 2, 4, 16, 2, 256]) is None
    assert scaled.scales_shape([3, 2, 4, 16, 2, 256]) == [3, 2, 4, 16, 2, 2]


MANAGERS = [
    (mokv.PagedKVCacheManager, dict(available_cache_memory=1 << 22)),
    (mokv.NullKVCacheManager, dict(available_cache_memory=1 << 22)),
    (mokv.ContinuousKVCacheManager, {}),
]


@pytest.mark.parametrize("manager,extra", MANAGERS, ids=lambda m: getattr(m, "__name__", ""))
@pytest.mark.parametrize("tp", [1, 2])
def test_managers_hand_out_the_scales_leaf_beside_the_values(session, manager, extra, tp):
    strategy = "paged" if "available_cache_memory" in extra else "continuous"
    p = params(**FP8, cache_strategy=strategy, n_devices=tp)
    m = manager(p, 2, 32, 3, [CPU()] * tp, session, **extra)
    symbols = m.input_symbols()
    assert len(symbols) == tp
    for device in symbols:
        assert device.scales.dtype == DType.float32 and device.blocks.dtype == p.dtype
        # One scale per 128 lanes of each head of each token slot, the rest as the values'.
        assert list(device.scales.shape)[:-1] == list(device.blocks.shape)[:-1]
        assert int(device.scales.shape[-1]) == 2 and int(device.blocks.shape[-1]) == 256
    ctx = mokv.TextContext(tokens=[1, 2, 3], max_length=32)
    m.external_claim(ctx.request_id)
    inputs = m.fetch([ctx])
    for device in inputs:
        # The buffers a kernel writes: values and scales of the same pages, on the device.
        assert device.scales.shape[:-1] == device.blocks.shape[:-1]
        assert device.scales.shape[-1] == 2 and device.scales.dtype == DType.float32
    if manager is not mokv.NullKVCacheManager:  # the null manager's hold no pages
        assert inputs[0].scales is not inputs[-1].scales or tp == 1


def test_unscaled_fp8_pages_have_no_scales_leaf(session):
    p = params(dtype=DType.float8_e4m3fn)
    m = mokv.PagedKVCacheManager(p, 2, 32, 3, [CPU()], session, available_cache_memory=1 << 22)
    (symbols,) = m.input_symbols()
    assert type(symbols) is mokv.RaggedKVCacheInputs and symbols.blocks.dtype == p.dtype


def test_the_mojo_manager_refuses_fp8_pages_by_dtype(session):
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        mokv.MojoContinuousBatchingKVCacheManager(
            params(**FP8, cache_strategy="continuous"), 2, 32, 2, [CPU()], session
        )


@pytest.mark.parametrize("layout", [mokv.PAGED, mokv.CONTINUOUS], ids=["paged", "continuous"])
def test_mokv_cpu_kernels_refuse_unscaled_fp8_pages_by_name(layout):
    # mokv's CPU kernels hold scaled FP8 pages, paged or continuous (issue 53, item 2);
    # MAX's unscaled pages run on a GPU only, so a CPU collection of them is refused
    # when the graph is built (a GPU's: tests/ops/test_fp8_refusals.py).
    unscaled = params(dtype=DType.float8_e4m3fn)
    with Graph(
        "unscaled_on_cpu", input_types=layout.input_symbols(unscaled, 3, 32, DeviceRef.CPU())
    ) as g:
        fetch = mokv.FetchKVCacheCollection(unscaled, 3, layout)
        with pytest.raises(
            ValueError, match="without scales .MAX's unscaled FP8 pages. on the CPU"
        ):
            fetch(*g.inputs)


def fp8_manager(session) -> mokv.PagedKVCacheManager:
    return mokv.PagedKVCacheManager(
        params(**FP8), 2, 32, 3, [CPU()], session, available_cache_memory=1 << 22
    )


def test_max_cache_values_of_scaled_pages_are_max_s_with_the_scales(session):
    from max import tree
    from max.graph import BufferValue, Graph, TensorValue

    (symbols,) = fp8_manager(session).max_input_symbols()
    with Graph("max_form", input_types=tree.leaves(symbols)) as graph:
        cache = mokv.max_cache_values(graph.inputs)
        assert isinstance(cache.kv_scales, BufferValue)
        assert cache.kv_scales.dtype == DType.float32 and int(cache.kv_scales.shape[-1]) == 2
        assert isinstance(cache.scales_lookup_table, TensorValue)
        assert cache.scales_page_stride.dtype == DType.int64
        assert cache.attention_dispatch_metadata.shape[0] == 4
        with pytest.raises(ValueError, match="got 9"):
            mokv.max_cache_values(graph.inputs[:9])


@pytest.mark.skipif(
    DType.float8_e4m3fn not in DTYPE_CODES,
    reason="mokv's kernels take no FP8 pages yet (issue 53, the kernels' change)",
)
def test_the_fetcher_takes_a_manager_s_scaled_inputs_and_checks_the_scales(session):
    from max.graph import BufferType, Graph

    (symbols,) = fp8_manager(session).input_symbols()
    fetch = mokv.FetchPagedKVCacheCollection(params(**FP8), 3)
    wrong = BufferType(DType.float32, [*symbols.scales.shape[:-1], 1], device=symbols.scales.device)
    with Graph("fetch", input_types=[*symbols, wrong]) as graph:
        assert fetch(*graph.inputs[:5]).num_layers == 3
        with pytest.raises(TypeError, match="expects the 5 paged cache inputs of scaled pages"):
            fetch(*graph.inputs[:4])
        with pytest.raises(ValueError, match="scales"):
            fetch(*graph.inputs[:4], graph.inputs[5])
