"""`load_kv_manager`: MAX 26.7's loader, with its signature, building a mokv cache.

MAX's pipelines describe their cache with MAX's params (`max.nn.kv_cache`); this reads
them into mokv's `KVCacheParams` (`mokv_params`) and builds a mokv
`PagedKVCacheManager` behind MAX's manager interface (`KVCacheManager`). A params kind
or setting mokv does not hold yet is refused with `UnsupportedMaxParamsError` naming
it, never accepted and ignored:

    refused                                   what it is in MAX
    MultiKVCacheParams, RecurrentStateParams  cache groups: sliding-window, recurrent state
    MLAKVCacheParams, MSAKVCacheParams        latent (DeepSeek) and multi-step attention
    window_size                               sliding-window attention
    an FP8 / FP4 dtype, kvcache_quant_config  quantized KV pages
    num_draft_tokens, speculative_method      speculative decoding's draft slots
    is_di_enabled                             disaggregated prefill / decode
    kv_connector_config (not null)            MAX's host / disk / dKV tiers (mokv's own
                                              tiers come from `MokvOptions`)
    per_layer_buffers, slots_per_page         other page layouts
    allow_kv_head_replication past n_kv_heads  KV heads repeated across devices
    enable_dp_cross_replica_prefix_copy with  copying a prefix between replicas (mokv
      several replicas                        routes a request to its prefix instead)

The page hash follows `kv_hash_algo`: MAX's default "ahash64" (64-bit, not
cryptographic) becomes mokv's default "xxh3" (the same kind of key, and mokv confirms a
hit against the page's tokens); "sha256" stays SHA-256, with `kv_hash_seed` folded
into mokv's `prefix_hash_seed`.
"""

from __future__ import annotations

from typing import Any

from max.driver import is_virtual_device_mode
from max.engine import InferenceSession

from ..config.base import CACHE_DTYPES
from ..config.params import KVCacheParams
from ..errors import MokvError
from .manager import KVCacheManager
from .options import MokvOptions


class UnsupportedMaxParamsError(MokvError, ValueError):
    """MAX params (or a MAX setting) that mokv does not hold yet; the message names it."""


def _refuse(what: str) -> UnsupportedMaxParamsError:
    return UnsupportedMaxParamsError(f"mokv does not hold {what} yet")


def check_supported(params: Any, is_di_enabled: bool = False) -> None:
    """UnsupportedMaxParamsError naming the first kind or setting of MAX's `params`
    that mokv's cache would not honour (module docstring)."""
    from max.nn.kv_cache import KVConnectorType, MHAKVCacheParams

    kind = type(params).__name__
    if type(params) is not MHAKVCacheParams:
        raise _refuse(
            f"{kind} caches (it holds MAX's MHAKVCacheParams: one full-attention cache "
            "of K and V pages)"
        )
    if params.window_size is not None:
        raise _refuse(f"sliding-window attention (window_size={params.window_size})")
    if params.dtype not in CACHE_DTYPES or params.kvcache_quant_config is not None:
        raise _refuse(
            f"quantized KV pages (dtype={params.dtype}, "
            f"kvcache_quant_config={params.kvcache_quant_config!r}); it stores "
            f"{[d.name for d in CACHE_DTYPES]}"
        )
    if params.num_draft_tokens or params.speculative_method is not None:
        raise _refuse(
            f"speculative decoding's draft tokens (num_draft_tokens={params.num_draft_tokens}, "
            f"speculative_method={params.speculative_method!r})"
        )
    if is_di_enabled:
        raise _refuse("disaggregated prefill and decode (is_di_enabled=True)")
    connector = params.kv_connector_config.type
    if connector != KVConnectorType.null:
        raise _refuse(
            f"MAX's KV connector {connector.value!r}; mokv's own host and shared tiers "
            "are set in MokvOptions (`mokv serve --mokv-config FILE`)"
        )
    if params.per_layer_buffers:
        raise _refuse("one buffer per layer (per_layer_buffers=True)")
    if params.slots_per_page != params.page_size:
        raise _refuse(f"compressed pages (slots_per_page={params.slots_per_page})")
    if params.n_kv_heads % params.tensor_parallel_degree:
        raise _refuse(
            f"KV heads repeated across devices (n_kv_heads={params.n_kv_heads} on "
            f"{params.tensor_parallel_degree} devices, allow_kv_head_replication)"
        )
    if params.data_parallel_degree > 1 and params.enable_dp_cross_replica_prefix_copy:
        raise _refuse(
            "copies of a prefix between data-parallel replicas "
            "(enable_dp_cross_replica_prefix_copy=True; `max serve "
            "--no-enable-dp-cross-replica-prefix-copy` turns it off: mokv routes a "
            "request to the replica holding its prefix instead)"
        )


def mokv_params(
    params: Any, options: MokvOptions | None = None, is_di_enabled: bool = False
) -> KVCacheParams:
    """mokv's `KVCacheParams` of MAX's `params` (checked: `check_supported`), with the
    tiers, events, sessions and pins of `options`."""
    check_supported(params, is_di_enabled)
    options = options or MokvOptions()
    if params.kv_hash_algo == "sha256":
        seed = params.kv_hash_seed or b""
        prefix_hash, prefix_hash_seed = "sha256", int.from_bytes(seed[:8].ljust(8, b"\0"), "little")
    elif params.kv_hash_algo == "ahash64":
        prefix_hash, prefix_hash_seed = "xxh3", 0
    else:
        raise _refuse(f"the page hash kv_hash_algo={params.kv_hash_algo!r}")
    return KVCacheParams(
        dtype=params.dtype,
        n_kv_heads=params.n_kv_heads,
        head_dim=params.head_dim,
        page_size=params.page_size,
        enable_prefix_caching=params.enable_prefix_caching,
        data_parallel_degree=params.data_parallel_degree,
        n_devices=params.n_devices,
        prefix_hash=prefix_hash,
        prefix_hash_seed=prefix_hash_seed,
        tiers=options.tiers,
        kv_events=options.kv_events,
        sessions=options.sessions,
        pins=options.pins,
    )


def load_kv_manager(
    params: Any,
    max_batch_size: int | None,
    max_seq_len: int,
    session: InferenceSession,
    available_cache_memory: int | None,
    is_di_enabled: bool,
    model_name: str,
    max_num_input_tokens: int | None,
    *,
    options: MokvOptions | None = None,
) -> KVCacheManager:
    """A mokv cache behind MAX's manager interface, for MAX's `params` (MAX 26.7's
    `max.pipelines.kv_cache.load_kv_manager`'s signature; `options`: mokv's tiers,
    events and sessions).

    `max_batch_size` is per data-parallel replica, as MAX's scheduler counts it, and
    `available_cache_memory` the bytes of all devices, as MAX's memory plan gives
    them: mokv's pool takes all of it, as MAX's own does. UnsupportedMaxParamsError for
    what mokv does not hold (module docstring); ValueError for a missing budget.
    """
    kv_params = mokv_params(params, options, is_di_enabled)
    if is_virtual_device_mode():
        raise _refuse(
            "a cache on virtual (compile-only) devices: build the graph on "
            "mokv.NullKVCacheManager's input symbols instead"
        )
    if available_cache_memory is None or max_batch_size is None:
        raise ValueError(
            f"available_cache_memory={available_cache_memory!r} and "
            f"max_batch_size={max_batch_size!r} must come from MAX's memory plan"
        )
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size!r}")
    return KVCacheManager.create(
        params,
        kv_params,
        max_batch_size=max_batch_size * params.data_parallel_degree,
        max_seq_len=max_seq_len,
        session=session,
        available_cache_memory=available_cache_memory,
        model_name=model_name,
        max_num_input_tokens=max_num_input_tokens,
    )


load_kv_manager.mokv_loader = True  # type: ignore[attr-defined]  # seams.check_seams
