"""MAX 26.7's cache params read as mokv's (`mokv_params`), for `load_kv_manager`.

MAX's pipelines describe their cache with MAX's params (`max.nn.kv_cache`); `mokv_params`
reads them into mokv's `KVCacheParams`. A params kind or setting mokv does not hold yet
is refused with `UnsupportedMaxParamsError` naming it, never accepted and ignored:

    refused                                   what it is in MAX
    nested trees, two RecurrentStateParams,   drafts' caches, a state with no
      one without an attention child,         attention beside it, per-request
      scratch regions                         scratch (speculative verify rings)
    MSAKVCacheParams                          multi-step attention
    a windowed MLA cache                      a latent window
    int8, FP4, float8_e4m3fnuz dtypes; FP8     quantized KV pages mokv does not store
      scales that are not float32             (docs/quantized.md)
    num_draft_tokens, speculative_method      speculative decoding's draft slots
    is_di_enabled                             disaggregated prefill / decode
    kv_connector_config (not null)            MAX's host / disk / dKV tiers (mokv's own
                                              tiers come from `MokvOptions`)
    per_layer_buffers, slots_per_page         other page layouts
    allow_kv_head_replication past n_kv_heads  KV heads repeated across devices
    enable_dp_cross_replica_prefix_copy with  copying a prefix between replicas (mokv
      several replicas                        routes a request to its prefix instead)

Cache groups. MAX's `MultiKVCacheParams` of `MHAKVCacheParams` children (Gemma 3 and 4,
GPT-OSS, Olmo 3: "sliding_attention" and "full_attention") becomes mokv's
`KVCacheParams.groups`, one `CacheGroupConfig` per child, in the children's order, each
with the child's layers, heads, head size and `window_size`; a single
`MHAKVCacheParams` with a `window_size` is one sliding-window group. Children must share
a dtype (each is checked as above).

Recurrent state. A `RecurrentStateParams` child beside the attention children (Qwen3.5's
tree: "attn" and "state"; Nemotron-H's) becomes `KVCacheParams.recurrent`, one
`StateRegion` per region in MAX's order, checkpointed as `MokvOptions.state_checkpoints`
says (docs/recurrent.md); its devices and replicas must be the attention children's.

FP8 pages. float8_e4m3fn with a `kvcache_quant_config` (float32 scales) becomes
`KVCacheParams.quantization` (`KVCacheQuantization` of the config's scale dtype and
granularity): scaled pages. float8_e4m3fn without one, what MAX's Llama builds for
`--kv-cache-format float8_e4m3fn`, is mokv's unscaled FP8 format (docs/quantized.md).

MLA. MAX's `MLAKVCacheParams` (DeepSeek V2 and V3, Kimi K2, GLM-5: one latent of
`head_dim` per token and layer) becomes a cache of one MLA group
(`CacheGroupConfig(latent_dim=, rope_dim=)`, named `MLA_GROUP`). MAX's params do not
split the latent from its RoPE key; MAX's MLA kernels take `qk_rope_dim=64` (every
MLA model MAX 26.7 serves), so mokv reads `rope_dim = MLA_ROPE_DIM` and `latent_dim =
head_dim - 64` (a head_dim of 64 or less is refused). A `MultiKVCacheParams` may hold
`MLAKVCacheParams` children, as MAX's own manager takes them (DeepSeek V3.2's "mla" and
"indexer", an MTP draft's "target" and "draft"): each is an MLA group of that name.

The page hash follows `kv_hash_algo`: MAX's default "ahash64" (64-bit, not
cryptographic) becomes mokv's default "xxh3" (the same kind of key, and mokv confirms a
hit against the page's tokens); "sha256" stays SHA-256, with `kv_hash_seed` folded
into mokv's `prefix_hash_seed`.
"""

from __future__ import annotations

from typing import Any

from ..config.base import CACHE_DTYPES
from ..config.groups import CacheGroupConfig
from ..config.params import KVCacheParams
from ..config.quantization import QUANTIZED_DTYPES, SCALE_DTYPES, KVCacheQuantization
from ..config.recurrent import RecurrentStateConfig, StateCheckpointConfig, StateRegion
from ..errors import MokvError
from .options import MokvOptions


class UnsupportedMaxParamsError(MokvError, ValueError):
    """MAX params (or a MAX setting) that mokv does not hold yet; the message names it."""


def refuse(what: str) -> UnsupportedMaxParamsError:
    return UnsupportedMaxParamsError(f"mokv does not hold {what} yet")


SLIDING_GROUP = "sliding_attention"
"""The group name of a single windowed `MHAKVCacheParams` (MAX's key for the windowed
child of its hybrid trees)."""


MLA_GROUP = "mla"
"""The group name of MAX's `MLAKVCacheParams`."""

MLA_ROPE_DIM = 64
"""The RoPE part of MAX's MLA latent: `qk_rope_dim` of MAX 26.7's MLA kernels
(`max.nn.kernels.flare_mla_*`), DeepSeek's `qk_rope_head_dim`."""


SHARED_FIELDS = (
    "dtype",
    "head_dim",
    "page_size",
    "enable_prefix_caching",
    "data_parallel_degree",
    "n_devices",
)
"""The fields of mokv's `KVCacheParams` that MAX's (first) cache gives as they are
(and `n_kv_heads`, which an MLA cache lacks)."""


def max_leaves(params: Any) -> list[tuple[str | None, Any]]:
    """`(child key, MHAKVCacheParams)` of each attention cache of MAX's `params`, in
    MAX's tree order: the children of a `MultiKVCacheParams`, or `(None, params)`.
    UnsupportedMaxParamsError naming a kind mokv does not hold."""
    from max.nn.kv_cache import MHAKVCacheParams, MLAKVCacheParams, MultiKVCacheParams

    what = (
        "one full-attention, sliding-window or MLA cache, or a tree of them "
        "(MHAKVCacheParams and MLAKVCacheParams)"
    )
    if type(params) in (MHAKVCacheParams, MLAKVCacheParams):
        return [(None, params)]
    if type(params) is not MultiKVCacheParams:
        raise refuse(f"{type(params).__name__} caches (it holds {what})")
    leaves = []
    for key, child in params.children.items():
        if key == _state_key(params):
            continue
        if type(child) not in (MHAKVCacheParams, MLAKVCacheParams):
            raise refuse(
                f"{type(child).__name__} caches (child {key!r} of the MultiKVCacheParams; "
                f"it holds {what})"
            )
        if not key.isidentifier():
            raise refuse(f"a cache child named {key!r} (a group's name is an identifier)")
        leaves.append((key, child))
    if not leaves:
        raise refuse("a recurrent state with no attention cache beside it")
    dtypes = {child.dtype for _, child in leaves}
    if len(dtypes) > 1:
        raise refuse(f"cache groups of different dtypes ({sorted(d.name for d in dtypes)})")
    configs = {repr(child.kvcache_quant_config) for _, child in leaves}
    if len(configs) > 1:
        raise refuse(f"cache groups of different kvcache_quant_config ({sorted(configs)})")
    return leaves


def _state_key(params: Any) -> str | None:
    """The key of the `RecurrentStateParams` child of MAX's `MultiKVCacheParams`, if one
    (UnsupportedMaxParamsError for two)."""
    from max.nn.kv_cache import RecurrentStateParams

    keys = [k for k, c in params.children.items() if type(c) is RecurrentStateParams]
    if len(keys) > 1:
        raise refuse(f"two RecurrentStateParams children ({keys}: a speculative pair's)")
    return keys[0] if keys else None


def max_state(params: Any) -> tuple[str, Any] | None:
    """`(child key, RecurrentStateParams)` of MAX's `params`, or None: checked against
    the attention children (module docstring)."""
    from max.nn.kv_cache import KVConnectorType, MultiKVCacheParams

    if type(params) is not MultiKVCacheParams:
        return None
    key = _state_key(params)
    if key is None:
        return None
    state = params.children[key]
    (_, first), *_ = max_leaves(params)
    scratch = [r.leaf_id for r in state.regions if r.scratch]
    if scratch:
        raise refuse(f"scratch state regions ({scratch}: a speculative verify's)")
    if state.num_draft_tokens or state.speculative_method is not None:
        raise refuse(f"a state with draft tokens (num_draft_tokens={state.num_draft_tokens})")
    if state.kv_connector_config.type != KVConnectorType.null:
        raise refuse(f"MAX's KV connector {state.kv_connector_config.type.value!r} on a state")
    where = (list(state.devices), state.data_parallel_degree)
    if where != (list(first.devices), first.data_parallel_degree):
        raise refuse(
            f"a state on other devices or replicas than its attention ({where[0]}, "
            f"data_parallel_degree={where[1]})"
        )
    return key, state


def mokv_state(
    params: Any, checkpoints: StateCheckpointConfig | None, enable_prefix_caching: bool
) -> RecurrentStateConfig | None:
    """mokv's recurrent state of MAX's `params` (None without a state child): its regions,
    checkpointed as `checkpoints` says (none without prefix caching)."""
    found = max_state(params)
    if found is None:
        if checkpoints is not None:
            raise refuse(f"state_checkpoints={checkpoints!r} for a model with no recurrent state")
        return None
    key, state = found
    checkpoints = checkpoints or StateCheckpointConfig()
    return RecurrentStateConfig(
        key,
        tuple(StateRegion(r.leaf_id, r.num_layers, r.row_shape, r.dtype) for r in state.regions),
        checkpoints.checkpoint_every,
        checkpoints.num_checkpoints if enable_prefix_caching else 0,
    )


def max_num_layers(params: Any) -> int:
    """Layers of MAX's `params`, every attention cache's together."""
    return sum(leaf.num_layers for _, leaf in max_leaves(params))


def check_supported(params: Any, is_di_enabled: bool = False) -> None:
    """UnsupportedMaxParamsError naming the first kind or setting of MAX's `params`
    that mokv's cache would not honour (module docstring)."""
    for _, leaf in max_leaves(params):
        _check_leaf(leaf)
    if is_di_enabled:
        raise refuse("disaggregated prefill and decode (is_di_enabled=True)")


def _check_leaf(params: Any) -> None:
    """`check_supported` of one `MHAKVCacheParams` or `MLAKVCacheParams`."""
    from max.nn.kv_cache import KVConnectorType, MLAKVCacheParams

    if type(params) is MLAKVCacheParams:
        _check_mla(params)

    quantization(params)
    if params.num_draft_tokens or params.speculative_method is not None:
        raise refuse(
            f"speculative decoding's draft tokens (num_draft_tokens={params.num_draft_tokens}, "
            f"speculative_method={params.speculative_method!r})"
        )
    connector = params.kv_connector_config.type
    if connector != KVConnectorType.null:
        raise refuse(
            f"MAX's KV connector {connector.value!r}; mokv's own host and shared tiers "
            "are set in MokvOptions (`mokv serve --mokv-config FILE`)"
        )
    if params.per_layer_buffers:
        raise refuse("one buffer per layer (per_layer_buffers=True)")
    if params.slots_per_page != params.page_size:
        raise refuse(f"compressed pages (slots_per_page={params.slots_per_page})")
    if mla_q_heads(params) is None and params.n_kv_heads % params.tensor_parallel_degree:
        raise refuse(
            f"KV heads repeated across devices (n_kv_heads={params.n_kv_heads} on "
            f"{params.tensor_parallel_degree} devices, allow_kv_head_replication)"
        )
    if params.data_parallel_degree > 1 and params.enable_dp_cross_replica_prefix_copy:
        raise refuse(
            "copies of a prefix between data-parallel replicas "
            "(enable_dp_cross_replica_prefix_copy=True; `max serve "
            "--no-enable-dp-cross-replica-prefix-copy` turns it off: mokv routes a "
            "request to the replica holding its prefix instead)"
        )


def _check_mla(params: Any) -> None:
    """UnsupportedMaxParamsError naming what a mokv MLA group cannot be."""
    if params.window_size is not None:
        raise refuse(f"a windowed MLA cache (window_size={params.window_size})")
    if params.head_dim <= MLA_ROPE_DIM:
        raise refuse(
            f"an MLA latent of head_dim={params.head_dim} (it ends in MAX's "
            f"{MLA_ROPE_DIM}-wide RoPE key)"
        )


def n_kv_heads(params: Any) -> int:
    """KV heads of one MAX leaf, all devices together: an MLA cache's one latent (MAX's
    `MLAKVCacheParams` has no `n_kv_heads`; each device holds it whole)."""
    from max.nn.kv_cache import MLAKVCacheParams

    return 1 if type(params) is MLAKVCacheParams else params.n_kv_heads


def mla_q_heads(params: Any) -> int | None:
    """Query heads per device of a MAX leaf's MLA layers; None for K and V heads."""
    from max.nn.kv_cache import MLAKVCacheParams

    return params.num_q_heads_per_device if type(params) is MLAKVCacheParams else None


def quantization(params: Any) -> KVCacheQuantization | None:
    """mokv's `KVCacheQuantization` of a MAX leaf's `kvcache_quant_config` (None:
    unquantized or unscaled FP8 pages); UnsupportedMaxParamsError naming a quantized
    format mokv does not store (module docstring)."""
    config = params.kvcache_quant_config
    stored = [d.name for d in CACHE_DTYPES + QUANTIZED_DTYPES]
    if params.dtype not in CACHE_DTYPES + QUANTIZED_DTYPES:
        raise refuse(f"quantized KV pages of dtype={params.dtype}; it stores {stored}")
    if config is None:
        return None
    if params.dtype not in QUANTIZED_DTYPES or config.scale_dtype not in SCALE_DTYPES:
        raise refuse(
            f"quantized KV pages of dtype={params.dtype} with scale_dtype="
            f"{config.scale_dtype} (kvcache_quant_config={config!r}); it stores "
            f"{[d.name for d in QUANTIZED_DTYPES]} pages with "
            f"{[d.name for d in SCALE_DTYPES]} scales"
        )
    return KVCacheQuantization(config.scale_dtype, config.quantization_granularity)


def mokv_groups(params: Any) -> tuple[CacheGroupConfig, ...]:
    """mokv's cache groups of MAX's `params` (module docstring): none for one
    full-attention `MHAKVCacheParams`."""
    from max.nn.kv_cache import MLAKVCacheParams

    leaves = max_leaves(params)
    if type(params) is MLAKVCacheParams:
        latent = params.head_dim - MLA_ROPE_DIM
        return (
            CacheGroupConfig(
                MLA_GROUP, params.num_layers, latent_dim=latent, rope_dim=MLA_ROPE_DIM
            ),
        )
    if leaves == [(None, params)]:
        if params.window_size is None:
            return ()
        return (CacheGroupConfig(SLIDING_GROUP, params.num_layers, params.window_size),)
    return tuple(
        CacheGroupConfig(
            key, leaf.num_layers, latent_dim=leaf.head_dim - MLA_ROPE_DIM, rope_dim=MLA_ROPE_DIM
        )
        if type(leaf) is MLAKVCacheParams
        else CacheGroupConfig(
            key, leaf.num_layers, leaf.window_size, leaf.n_kv_heads, leaf.head_dim
        )
        for key, leaf in leaves
        if key is not None
    )


def mokv_params(
    params: Any, options: MokvOptions | None = None, is_di_enabled: bool = False
) -> KVCacheParams:
    """mokv's `KVCacheParams` of MAX's `params` (checked: `check_supported`), with the
    tiers, events, sessions and pins of `options`."""
    check_supported(params, is_di_enabled)
    options = options or MokvOptions()
    (_, first), *_ = max_leaves(params)
    if first.kv_hash_algo == "sha256":
        seed = first.kv_hash_seed or b""
        prefix_hash, prefix_hash_seed = "sha256", int.from_bytes(seed[:8].ljust(8, b"\0"), "little")
    elif first.kv_hash_algo == "ahash64":
        prefix_hash, prefix_hash_seed = "xxh3", 0
    else:
        raise refuse(f"the page hash kv_hash_algo={first.kv_hash_algo!r}")
    return KVCacheParams(
        **{field: getattr(first, field) for field in SHARED_FIELDS},
        n_kv_heads=n_kv_heads(first),
        prefix_hash=prefix_hash,
        prefix_hash_seed=prefix_hash_seed,
        tiers=options.tiers,
        kv_events=options.kv_events,
        sessions=options.sessions,
        pins=options.pins,
        groups=mokv_groups(params),
        recurrent=mokv_state(params, options.state_checkpoints, first.enable_prefix_caching),
        quantization=quantization(first),
    )
