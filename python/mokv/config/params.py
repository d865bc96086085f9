"""Static configuration of a KV cache: its shape, its prefix cache, its tiers, sessions and
events.

One frozen `KVCacheParams` flows from the user into every manager, graph type and
kernel wrapper; nothing else carries configuration. Its own fields are the cache's
shape and the prefix cache; the lower tiers, sessions and the KV-cache events are nested
frozen configs (`HostTierConfig`, `RemoteTierConfig`: `mokv.config.tiers`; `SessionConfig`:
`mokv.config.sessions`; `KVEventsConfig`: `mokv.config.events`), each checked in its own
`__post_init__` and then against the params it joins. Derived sizes are properties so
that they cannot drift from the fields they come from.

MAX's flat spellings (`enable_kvcache_swapping_to_host=True`, `remote_kvcache_url=...`)
are still accepted, and mapped onto the nested configs in one place:
`mokv.config.flat`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from max.dtype import DType

from .base import CACHE_DTYPES, PREFIX_HASH_ALGORITHMS, STABLE_ALGORITHMS
from .cache_control import PinConfig
from .events import KVEventsConfig, check_endpoint
from .flat import accepts_flat_spellings
from .groups import CacheGroupConfig, check_groups
from .quantization import (
    QUANTIZED_DTYPES,
    KVCacheQuantization,
    check_format,
    refuse_other_formats,
)
from .recurrent import STATE_REGION_ID, RecurrentStateConfig
from .sessions import SessionConfig
from .tiers import HostTierConfig, RemoteTierConfig, TierConfig

Dim = TypeVar("Dim", bound=int | str)
"""A dim of a shape: static (int) or symbolic (str)."""


class KVCacheStrategy(str, enum.Enum):
    """How cache memory is handed to sequences.

    CONTINUOUS: one contiguous `max_seq_len` slot per sequence.
    PAGED: fixed-size pages from a shared pool, with an optional prefix cache.
    """

    CONTINUOUS = "continuous"
    PAGED = "paged"


@accepts_flat_spellings
@dataclass(frozen=True)
class KVCacheParams:
    """The shape of the cache, its prefix cache, and the tiers and events it turns on.

    Attributes:
        dtype: element type of the cached keys and values: float32, bfloat16, float16,
            or float8_e4m3fn: with `quantization`, MAX's FP8 pages with per-block scales;
            without, MAX's unscaled FP8 pages (what its Llama pipeline builds for
            `--kv-cache-format float8_e4m3fn`; docs/quantized.md).
        n_kv_heads: key/value heads of the model (all devices together).
        head_dim: size of one head's key or value vector.
        page_size: tokens per page of the paged cache.
        cache_strategy: `KVCacheStrategy.PAGED` or `KVCacheStrategy.CONTINUOUS`: the
            manager `load_kv_manager` builds (a manager built directly is its own layout).
        enable_prefix_caching: share full pages between requests whose token
            prefixes are identical (paged strategy only).
        data_parallel_degree: number of independent replicas of the cache, each
            with its own page pool on its own group of devices.
        n_devices: total devices; each replica gets `n_devices // data_parallel_degree`
            of them and splits its KV heads across them (tensor parallelism).
        prefix_hash: hash of a page's (parent hash, token ids) chain: "xxh3"
            (default: seeded XXH3-64, fastest, stable across processes and machines),
            "sha256" (vLLM's 64-bit form, stable) or, opt-in, "builtin" (Python's
            `hash`, stable within one process only; refused with KV-cache events).
        prefix_hash_seed: mixed into the root of every hash chain, so that two
            caches with different seeds never share a page.
        tiers: the tiers below the device pages, in lookup order (fastest first), at
            most one of each kind: `HostTierConfig` (host memory), `RemoteTierConfig`
            (a Redis server several managers share). Paged strategy only; each needs
            `enable_prefix_caching` (README "Host tier", "Shared tier").
        kv_events: publish the prefix cache's changes in vLLM's KV-event format
            (paged strategy; needs a stable `prefix_hash`); None: no events.
        sessions: retain the pages of requests that name a session (`ctx.session_id`)
            after their release, until the session ends (`SessionConfig`; paged
            strategy, needs `enable_prefix_caching`); None: a session id is ignored.
        groups: the model's cache groups, in graph-input order (`CacheGroupConfig`:
            full-attention, sliding-window and MLA layers, each group with its own pages;
            paged strategy); empty: one full-attention group of every layer.
        pins: let requests pin prefixes with a time to live (`ctx.cache_control`,
            `PinConfig`; paged strategy, needs `enable_prefix_caching`); None: a
            request that asks for a pin is refused.
        quantization: the scales of quantized pages (`KVCacheQuantization`: float32
            scales, one per token, head and 128 lanes), given with a float8_e4m3fn
            `dtype` and only then; None: the pages hold their values as they are (or
            cast to FP8, unscaled).
        recurrent: the recurrent state of a hybrid model's linear-attention or
            state-space layers, with its checkpoints (`RecurrentStateConfig`; paged
            strategy, beside `groups`' attention layers); None: no state layers.
    """

    dtype: DType
    n_kv_heads: int
    head_dim: int
    page_size: int = 128
    cache_strategy: KVCacheStrategy = KVCacheStrategy.PAGED
    enable_prefix_caching: bool = False
    data_parallel_degree: int = 1
    n_devices: int = 1
    prefix_hash: str = "xxh3"
    prefix_hash_seed: int = 0
    tiers: tuple[TierConfig, ...] = ()
    kv_events: KVEventsConfig | None = None
    sessions: SessionConfig | None = None
    groups: tuple[CacheGroupConfig, ...] = ()
    pins: PinConfig | None = None
    quantization: KVCacheQuantization | None = None
    recurrent: RecurrentStateConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            raise TypeError(f"dtype must be a max.dtype.DType, got {self.dtype!r}")
        if self.dtype not in CACHE_DTYPES + QUANTIZED_DTYPES:
            refuse_other_formats(self.dtype)
            raise ValueError(
                f"dtype={self.dtype} is not a supported cache dtype; use one of "
                f"{[d.name for d in CACHE_DTYPES + QUANTIZED_DTYPES]}"
            )
        for name in ("n_kv_heads", "head_dim", "page_size", "data_parallel_degree", "n_devices"):
            value = getattr(self, name)
            # At most 2**32 - 1, as a manager's sizes: past it no device holds one page,
            # and MAX's buffers refuse dims past 64 bits with an untyped error.
            if value.__class__ is not int or not 1 <= value < 2**32:
                raise ValueError(f"{name} must be a positive int below 2**32, got {value!r}")
        check_format(self.dtype, self.quantization, self.head_dim)
        # Accept the enum's string value too ("paged"), as configs often come from text.
        object.__setattr__(self, "cache_strategy", KVCacheStrategy(self.cache_strategy))
        if self.n_devices % self.data_parallel_degree:
            raise ValueError(
                f"n_devices={self.n_devices} is not a multiple of "
                f"data_parallel_degree={self.data_parallel_degree}"
            )
        self._check_groups()
        if self.prefix_hash not in PREFIX_HASH_ALGORITHMS:
            raise ValueError(
                f"prefix_hash={self.prefix_hash!r} is not one of {PREFIX_HASH_ALGORITHMS}"
            )
        if self.enable_prefix_caching.__class__ is not bool:
            raise TypeError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
        seed = self.prefix_hash_seed
        if seed.__class__ is not int or not 0 <= seed < 2**64:
            raise ValueError(f"prefix_hash_seed must be an int in [0, 2**64), got {seed!r}")
        self._check_tiers()
        if self.kv_events is not None:
            if not isinstance(self.kv_events, KVEventsConfig):
                raise TypeError(
                    f"kv_events must be a mokv.KVEventsConfig or None, got {self.kv_events!r}"
                )
            if self.prefix_hash not in STABLE_ALGORITHMS:
                raise ValueError(
                    f"KV-cache events need a hash that is the same in every process; "
                    f"prefix_hash={self.prefix_hash!r} is not one of {STABLE_ALGORITHMS}"
                )
            self.kv_events.check(self)
        if self.sessions is not None:
            if not isinstance(self.sessions, SessionConfig):
                raise TypeError(
                    f"sessions must be a mokv.SessionConfig or None, got {self.sessions!r}"
                )
            self.sessions.check(self)
        if self.pins is not None:
            if not isinstance(self.pins, PinConfig):
                raise TypeError(f"pins must be a mokv.PinConfig or None, got {self.pins!r}")
            self.pins.check(self)
        self._check_recurrent()

    def _check_groups(self) -> None:
        """The groups, and the heads a replica's devices split (none in an MLA cache)."""
        if not isinstance(self.groups, (tuple, list)):
            raise TypeError(f"groups must be a tuple of CacheGroupConfig, got {self.groups!r}")
        object.__setattr__(self, "groups", tuple(self.groups))
        check_groups(self.groups)
        mla = self.mla_group
        if mla is not None and self.dtype in QUANTIZED_DTYPES:
            raise ValueError(
                f"dtype={self.dtype}: mokv does not store FP8 MLA latents (group {mla.name!r})"
            )
        if mla is not None:  # the whole cache is one MLA group: its shape is the params'
            if (self.n_kv_heads, self.head_dim) != (1, mla.mla_head_dim):
                raise ValueError(
                    f"a cache of one MLA group {mla.name!r} holds one latent of "
                    f"latent_dim + rope_dim = {mla.mla_head_dim} per token: n_kv_heads must "
                    f"be 1 and head_dim {mla.mla_head_dim}, got n_kv_heads={self.n_kv_heads}, "
                    f"head_dim={self.head_dim}"
                )
            return
        # The params' own heads are split only where a group has no heads of its own (an
        # MLA group's latent is whole on each device).
        own_heads = [g for g in self.groups if g.kind != "mla" and g.n_kv_heads is None]
        if (own_heads or not self.groups) and self.n_kv_heads % self.tensor_parallel_degree:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} cannot be split evenly across the "
                f"{self.tensor_parallel_degree} devices of a replica"
            )
        for group in self.groups:  # each group's shape is a KVCacheParams of its own
            self.group_params(group)

    def _check_recurrent(self) -> None:
        """TypeError / ValueError naming what a cache with state layers cannot honour
        yet: another strategy, checkpoints without prefix caching, a tier other than
        the host and shared tiers, and a region id the shared tier's keys cannot name,
        each by name."""
        state = self.recurrent
        if state is None:
            return
        if not isinstance(state, RecurrentStateConfig):
            raise TypeError(f"recurrent must be a mokv.RecurrentStateConfig or None, got {state!r}")
        if self.cache_strategy is not KVCacheStrategy.PAGED:
            raise ValueError(f"recurrent state needs the paged strategy, not {self.cache_strategy}")
        if state.num_checkpoints and not self.enable_prefix_caching:
            raise ValueError(
                f"recurrent state {state.name!r}: num_checkpoints={state.num_checkpoints} "
                "needs enable_prefix_caching (checkpoints are found by prefix hashes)"
            )
        for tier in self.tiers:  # they keep checkpoints (`groups/state_host.py`, `_shared.py`)
            if not isinstance(tier, (HostTierConfig, RemoteTierConfig)):
                raise ValueError(
                    f"tier {tier.name!r} with recurrent state {state.name!r}: mokv keeps "
                    "state checkpoints in the host and shared tiers only, not yet in this one"
                )
            if isinstance(tier, RemoteTierConfig):  # its keys name the regions
                for region in state.regions:
                    if not STATE_REGION_ID.fullmatch(region.leaf_id):
                        raise ValueError(
                            f"state region {region.leaf_id!r} with the shared tier: its keys "
                            "need region ids of 1-64 characters of [A-Za-z0-9_]"
                        )

    def _check_tiers(self) -> None:
        if not isinstance(self.tiers, (tuple, list)):
            raise TypeError(f"tiers must be a tuple of tier configs, got {self.tiers!r}")
        object.__setattr__(self, "tiers", tuple(self.tiers))  # a list is accepted, kept frozen
        names: set[str] = set()
        for tier in self.tiers:
            if not isinstance(tier, TierConfig):
                raise TypeError(
                    f"tiers holds {tier!r}; a tier is a mokv.HostTierConfig or "
                    "mokv.RemoteTierConfig (or another mokv.config.tiers.TierConfig)"
                )
            if tier.name in names:
                raise ValueError(f"tiers holds two {tier.name!r} tiers: {self.tiers!r}")
            names.add(tier.name)
            tier.check(self)

    @property
    def tensor_parallel_degree(self) -> int:
        """Devices per replica; the KV heads are split across them."""
        return self.n_devices // self.data_parallel_degree

    @property
    def mla_group(self) -> CacheGroupConfig | None:
        """The group, when the whole cache is one MLA group (`CacheGroupConfig.latent_dim`);
        else None."""
        groups = self.groups
        return groups[0] if len(groups) == 1 and groups[0].kind == "mla" else None

    @property
    def kv_dim(self) -> int:
        """Tensors each token slot of a page holds: 2 (K and V), or 1 (an MLA latent)."""
        return 1 if self.mla_group is not None else 2

    @property
    def n_kv_heads_per_device(self) -> int:
        """KV heads stored on each device of a replica: an MLA latent is whole on each."""
        if self.mla_group is not None:
            return 1
        return self.n_kv_heads // self.tensor_parallel_degree

    @property
    def scales_per_head(self) -> int:
        """Scales of one token's head: `head_dim // granularity`; 0 for pages that are
        not quantized."""
        if self.quantization is None:
            return 0
        return self.quantization.scales_per_head(self.head_dim)

    @property
    def page_format(self) -> str:
        """The format a page's hash is keyed by (`mokv.cache.hashing`, "Formats"): for
        scaled pages "dtype:scale dtype:granularity" (MAX's dKV layout tag, e.g.
        "float8_e4m3fn:float32:128"); for unscaled FP8 pages the dtype alone
        ("float8_e4m3fn"); "" for unquantized pages, whose hashes predate formats."""
        q = self.quantization
        if q is None:
            return self.dtype.name if self.dtype in QUANTIZED_DTYPES else ""
        return f"{self.dtype.name}:{q.scale_dtype.name}:{q.granularity}"

    def scales_shape(self, values_shape: Sequence[Dim]) -> list[Dim | int] | None:
        """The shape of the scales leaf beside a values buffer of `values_shape` (its last
        dim, the head, holds `scales_per_head` scales instead: MAX's
        `shape_per_scale_block`); None for pages without scales."""
        if self.quantization is None:
            return None
        return [*values_shape[:-1], self.scales_per_head]

    def bytes_per_token(self, num_layers: int) -> int:
        """Bytes that one token occupies in one replica (all its devices), its scales
        included (MAX's `bytes_per_block`, per token).

        `kv_dim * num_layers * n_kv_heads_per_device * (head_dim * dtype size
        + scales_per_head * scale dtype size)` on each of the `tensor_parallel_degree`
        devices: K and V split across the devices, or an MLA latent counted once per
        device (each holds all of it).
        """
        head_bytes = self.head_dim * self.dtype.size_in_bytes
        if self.quantization is not None:
            head_bytes += self.scales_per_head * self.quantization.scale_dtype.size_in_bytes
        per_device = self.kv_dim * num_layers * self.n_kv_heads_per_device * head_bytes
        return per_device * self.tensor_parallel_degree

    def bytes_per_page(self, num_layers: int) -> int:
        """Bytes of one page in one replica: `page_size * bytes_per_token(num_layers)`."""
        return self.page_size * self.bytes_per_token(num_layers)

    @property
    def is_hybrid(self) -> bool:
        """Whether the cache is anything but one group of every token: several groups,
        or a sliding window (one MLA group is not: its pages are one full group's)."""
        groups = self.groups
        if self.recurrent is not None:
            return True
        return len(groups) > 1 or (len(groups) == 1 and groups[0].window_size is not None)

    def cache_groups(self, num_layers: int) -> tuple[CacheGroupConfig, ...]:
        """The groups of a model of `num_layers` layers: `groups`, whose layers must add
        up to `num_layers` (ValueError), or one full-attention group of them all."""
        if not self.groups:
            return (CacheGroupConfig("full_attention", num_layers),)
        total = sum(g.num_layers for g in self.groups)
        if total != num_layers:
            raise ValueError(
                f"the groups {[g.name for g in self.groups]} hold {total} layers, "
                f"but num_layers={num_layers}"
            )
        return self.groups

    def group_params(self, group: CacheGroupConfig) -> KVCacheParams:
        """The shape of one group's pages as params of their own: these params with the
        group's heads and head size, and no groups, tiers, events or sessions (what the
        layouts, kernels and sizing of one group read); an MLA group's keep it as their
        one group (`mla_group`)."""
        if group.kind == "mla":
            return dataclasses.replace(
                self,
                n_kv_heads=1,
                head_dim=group.mla_head_dim,
                tiers=(),
                kv_events=None,
                sessions=None,
                groups=(group,),
                recurrent=None,
            )
        return dataclasses.replace(
            self,
            n_kv_heads=group.n_kv_heads or self.n_kv_heads,
            head_dim=group.head_dim or self.head_dim,
            tiers=(),
            kv_events=None,
            sessions=None,
            groups=(),
            recurrent=None,
        )


def with_manager_events(
    params: KVCacheParams, zmq_endpoint_base: str | None, kv_events_config: KVEventsConfig | None
) -> KVCacheParams:
    """`params` with the events of a manager's keywords in `params.kv_events` (checked
    against the params' replicas)."""
    config = kv_events_config
    if config is not None and not isinstance(config, KVEventsConfig):
        raise TypeError(
            f"kv_events_config must be a mokv.KVEventsConfig or None, got {config!r}"
            + ("; for an address alone use zmq_endpoint_base" if isinstance(config, str) else "")
        )
    if zmq_endpoint_base is not None:
        check_endpoint("zmq_endpoint_base", zmq_endpoint_base)
        if config is None:
            config = KVEventsConfig(endpoint=zmq_endpoint_base)
        elif config.endpoint != zmq_endpoint_base:
            raise ValueError(
                f"zmq_endpoint_base={zmq_endpoint_base!r} disagrees with "
                f"kv_events_config.endpoint={config.endpoint!r}; set one"
            )
    if config is None or config == params.kv_events:
        return params
    if params.kv_events is not None:
        raise ValueError(
            f"the manager's events {config!r} disagree with params.kv_events="
            f"{params.kv_events!r}; set one"
        )
    return dataclasses.replace(params, kv_events=config)
