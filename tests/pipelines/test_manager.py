"""mokv.pipelines.KVCacheManager: MAX 26.7's manager interface over a mokv cache, checked
call by call against MAX's own manager (its Jenga manager on the CPU) on the same trace."""

from __future__ import annotations

import numpy as np
import pytest
from max.dtype import DType
from max.graph import DeviceRef
from max.nn.kv_cache import (
    BatchCharacteristics,
    KVCacheQuantizationConfig,
    MHAKVCacheParams,
    MultiKVCacheParams,
)
from max.pipelines.context import TextContext, TokenBuffer
from max.pipelines.kv_cache import InsufficientBlocksError, PagedKVCacheManagerInterface
from mokv import HostTierConfig
from mokv.pipelines import KVCacheManager, MokvOptions, UnsupportedMaxParamsError
from mokv.pipelines import load_kv_manager as mokv_loader

from .conftest import PAGE_BYTES, PAGE_SIZE, SYSTEM, loader_args, max_context, max_params

INPUT_FIELDS = (
    "cache_lengths",
    "max_prompt_length",
    "max_cache_length",
    "attention_dispatch_metadata",
    "page_stride",
)


def observe(inputs) -> list:
    """What a graph reads besides the page ids (those are each allocator's own choice)."""
    return [
        [getattr(device, name).to_numpy().tolist() for name in INPUT_FIELDS]
        + [device.lookup_table.shape, device.kv_blocks.shape]
        for device in inputs
    ]


def run_trace(manager) -> tuple[list, int]:
    """A served trace: two prompts sharing a page, decode steps, a capture replay, a
    release, and the first prompt again. Returns everything MAX's scheduler reads, and
    the metrics' input tokens."""
    seen: list = []
    a, b = max_context([60, 61, 62]), max_context([70, 71])
    manager.claim(a)
    manager.alloc(a)
    seen += [a.cached_prefix_length, observe(manager.runtime_inputs([[a]]))]
    a.update(5)
    manager.step(a)
    seen.append(manager.get_prefix_cache_hit_counts(b))
    manager.claim(b, replica_idx=0)
    manager.alloc(b)
    seen += [b.cached_prefix_length, b.tokens.processed_length, manager.num_req_blocks(b)]
    seen.append(observe(manager.runtime_inputs([[a, b]])))
    for ctx, token in ((a, 6), (b, 7)):
        ctx.update(token)
        manager.step(ctx)
        manager.alloc(ctx)
    # A decode step replayed on a captured device graph: inputs sized to its bounds.
    capture = BatchCharacteristics(batch_size=4, max_prompt_length=1, max_cache_valid_length=400)
    seen.append(
        observe(
            manager.runtime_inputs([[a, b]], max_cache_length=400, batch_characteristics=capture)
        )
    )
    for ctx, token in ((a, 8), (b, 9)):
        ctx.update(token)
        manager.step(ctx)
    seen.append(manager.block_count().used)  # pages in use
    metrics = manager.take_metrics_aggregated()
    seen.append((metrics.cache_tokens, metrics.device_blocks_served))
    input_tokens = metrics.input_tokens
    seen.append(manager.get_metrics_aggregated().cache_tokens)  # nothing since the take
    for ctx in (a, b):
        manager.release(ctx)
        seen.append(manager.contains(ctx))
    again = max_context([60, 61, 62])
    manager.claim(again)
    manager.alloc(again)
    seen.append(again.cached_prefix_length)
    manager.release(again)
    return seen, input_tokens


def test_it_is_max_s_paged_manager_interface(ours):
    assert isinstance(ours, PagedKVCacheManagerInterface)
    assert not KVCacheManager.__abstractmethods__  # every member is mokv's own
    assert ours.chunk_alignment_tokens == 0
    assert not ours.pending_transfers_exist(0)


def test_a_served_trace_reads_as_on_max_s_own_manager(max_own, ours):
    (seen, input_tokens), (theirs, their_input_tokens) = run_trace(ours), run_trace(max_own)
    assert seen == theirs
    # The prompts' uncached tokens (143 and 142 - 128); MAX counts the two decode steps'
    # tokens as input too, where mokv keeps MAX's documented meaning, prompt tokens
    # (docs/max.md lists the difference).
    assert (input_tokens, their_input_tokens) == (143 + 14, 143 + 14 + 2)


def test_each_request_s_pages_are_reported_per_leaf(max_own, ours):
    for manager in (max_own, ours):
        ctx = max_context(range(300))
        manager.claim(ctx)
        manager.alloc(ctx)
        (leaf,) = manager.get_req_blocks_per_leaf(ctx)
        assert leaf == "full_group"
        assert len(manager.get_req_blocks_per_leaf(ctx)[leaf]) == manager.num_req_blocks(ctx) == 4


def test_a_request_that_does_not_fit_raises_max_s_error_and_changes_nothing(session):
    manager = mokv_loader(**loader_args(session) | {"available_cache_memory": 5 * PAGE_BYTES})
    big, small = max_context(range(360)), max_context(range(60))
    for ctx in (big, small):
        manager.claim(ctx)
    manager.alloc(big)  # 4 of the 5 pages
    before = manager.block_count()
    with pytest.raises(InsufficientBlocksError, match="not enough free pages"):
        manager.alloc(small)  # two pages
    assert manager.block_count() == before
    assert manager.num_req_blocks(small) == 0 and small.cached_prefix_length is None
    assert small.tokens.processed_length == 0
    manager.shutdown()


def test_a_prefix_reset_waits_for_running_requests_and_then_happens(ours):
    ctx = max_context([1, 2, 3])
    ours.claim(ctx)
    ours.alloc(ctx)
    ctx.update(4)
    ours.step(ctx)  # its first page is a cached prefix now
    ours.reset_prefix_cache()  # refused by mokv while the request holds pages
    probe = max_context([9])
    assert ours.get_prefix_cache_hit_counts(probe)[0].device_blocks == 1
    ours.poll_transfers()
    assert ours.get_prefix_cache_hit_counts(probe)[0].device_blocks == 1
    ours.release(ctx)
    ours.poll_transfers()  # MAX's scheduler calls this at every iteration
    assert ours.get_prefix_cache_hit_counts(probe)[0].device_blocks == 0


def test_a_padding_request_holds_one_page_until_released(ours):
    dummy = TextContext.new_padding_context(max_length=512, model_name="base")
    dummy.update(0)  # as MAX's data-parallel padder makes them: one token in its cache
    ours.alloc_dummy(dummy, replica_idx=0)
    assert ours.num_req_blocks(dummy) == 1 and ours.contains(dummy)
    (inputs,) = ours.runtime_inputs([[dummy]])  # a decode row: one token, one cached
    assert observe([inputs])[0][:3] == [[1], [1], [2]]
    dummy.update(0)
    ours.step(dummy)
    ours.release(dummy)
    assert ours.block_count().free == ours.block_count().total


def test_host_tier_loads_report_their_tokens_as_external(session):
    options = MokvOptions(tiers=(HostTierConfig(swap_space_gb=0.01),))
    manager = mokv_loader(**loader_args(session), options=options)
    assert manager.host_byte_count().total > 0

    def serve(ctx) -> int:
        manager.claim(ctx)
        manager.alloc(ctx)
        manager.runtime_inputs([[ctx]])
        for token in range(3):
            ctx.update(token)
            manager.step(ctx)
            if ctx.tokens.current_position < 300:
                manager.alloc(ctx)
        manager.release(ctx)
        return ctx.cached_prefix_external_length

    serve(max_context([60, 61, 62]))  # its first page is written through to the host tier
    probe = max_context([1])
    seed = 0
    while manager.get_prefix_cache_hit_counts(probe)[0].device_blocks:
        # prompts without that page push it out of the 9 device pages
        tokens = np.random.default_rng(seed).integers(3, 256, 440)
        serve(TextContext(max_length=512, tokens=TokenBuffer(tokens)))
        seed += 1
        assert seed < 10
    assert manager.get_prefix_cache_hit_counts(probe)[0].external_blocks == 1
    assert serve(max_context([60, 61, 62])) == PAGE_SIZE  # found in the host tier, loaded
    assert manager.get_metrics_aggregated().h2d_bytes_copied == PAGE_BYTES
    manager.shutdown()


UNSUPPORTED = {
    "quantized KV pages of dtype=int8": dict(
        dtype=DType.int8,
        kvcache_quant_config=KVCacheQuantizationConfig(
            scale_dtype=DType.float16, quantization_granularity=16
        ),
    ),
    "quantized KV pages of dtype=float8_e4m3fn with scale_dtype=float8_e8m0fnu": dict(
        dtype=DType.float8_e4m3fn,
        kvcache_quant_config=KVCacheQuantizationConfig(
            scale_dtype=DType.float8_e8m0fnu, quantization_granularity=16
        ),
    ),
    "draft tokens": dict(num_draft_tokens=2),
    "per_layer_buffers": dict(per_layer_buffers=True),
    "slots_per_page": dict(slots_per_page=64),
    "prefix between data-parallel replicas": dict(
        devices=[DeviceRef.CPU(), DeviceRef.CPU()], data_parallel_degree=2
    ),
}


@pytest.mark.parametrize("what", sorted(UNSUPPORTED))
def test_max_settings_mokv_does_not_hold_are_refused_naming_them(session, what):
    with pytest.raises(UnsupportedMaxParamsError, match=what.split()[0]):
        mokv_loader(**loader_args(session, **UNSUPPORTED[what]))


def test_max_cache_kinds_mokv_does_not_hold_are_refused_naming_them(session):
    # MLA caches, alone or in a tree, are mokv's (tests/pipelines/test_mla.py); a tree
    # in a tree (a draft model's caches beside the target's) is not yet.
    inner = MultiKVCacheParams.from_params({"full": max_params()})
    groups = MultiKVCacheParams.from_params({"full": max_params(), "draft": inner})
    with pytest.raises(UnsupportedMaxParamsError, match="MultiKVCacheParams caches .child 'draft'"):
        mokv_loader(**loader_args(session) | {"params": groups})
    with pytest.raises(UnsupportedMaxParamsError, match="disaggregated"):
        mokv_loader(**loader_args(session) | {"is_di_enabled": True})
    assert isinstance(max_params(), MHAKVCacheParams)


def test_tenants_adapters_and_images_key_their_pages_apart(ours):
    """The same tokens share pages only under the same salt, adapter and images."""
    from max.pipelines.context import TextAndVisionContext
    from max.pipelines.context.tokens import ImageMetadata

    def image_prompt(image_hash):
        pixels = np.zeros((1, 1), np.float32)
        tokens = np.array(SYSTEM + [1], np.int64)
        tokens[3:10] = 0  # the image's placeholder tokens
        return TextAndVisionContext(
            max_length=512,
            tokens=TokenBuffer(tokens),
            vision_token_ids=[0],
            images=[
                ImageMetadata(start_idx=3, end_idx=10, pixel_values=pixels, image_hash=image_hash)
            ],
        )

    def served(ctx) -> int:
        ours.claim(ctx)
        ours.alloc(ctx)
        ours.runtime_inputs([[ctx]])
        ctx.update(1)
        ours.step(ctx)
        ours.release(ctx)
        return ctx.cached_prefix_length

    for first, again, shares in [
        (dict(cache_salt="a"), dict(cache_salt="b"), False),
        (dict(cache_salt="a"), dict(cache_salt="a"), True),
        (dict(model_name="adapter-1"), dict(model_name="adapter-2"), False),
        (dict(model_name="adapter-1"), dict(model_name="base"), False),  # the base model
        (dict(model_name="base"), dict(model_name=""), True),  # both the base model
    ]:
        ours.reset_prefix_cache()
        served(max_context([1], **first))
        assert served(max_context([1], **again)) == (PAGE_SIZE if shares else 0), (first, again)
    ours.reset_prefix_cache()
    served(image_prompt(1))
    assert served(image_prompt(2)) == 0  # same placeholder tokens, another image
    assert served(image_prompt(1)) == PAGE_SIZE


def test_a_salt_of_the_wrong_type_is_refused_not_taken_for_no_salt(ours):
    ctx = max_context([1])
    ctx.cache_salt = 0  # a server that keeps tenant ids as integers
    ours.claim(ctx)
    with pytest.raises(TypeError, match="salt"):
        ours.alloc(ctx)
    assert ours.num_req_blocks(ctx) == 0 and ctx.tokens.processed_length == 0
