"""Static configuration of a KV cache: what one token's keys and values look like.

One frozen `KVCacheParams` flows from the user into every manager, graph type and
kernel wrapper; nothing else carries configuration. Derived sizes are properties so
that they cannot drift from the fields they come from.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from max.dtype import DType


class KVCacheStrategy(str, enum.Enum):
    """How cache memory is handed to sequences.

    CONTINUOUS: one contiguous `max_seq_len` slot per sequence.
    PAGED: fixed-size pages from a shared pool, with an optional prefix cache.
    """

    CONTINUOUS = "continuous"
    PAGED = "paged"


CACHE_DTYPES = (DType.float32, DType.bfloat16, DType.float16)
"""Element types of the cache that mokv's kernels read and write."""

PREFIX_HASH_ALGORITHMS = ("xxh3", "sha256", "builtin")
"""Names accepted by `KVCacheParams.prefix_hash`; see `mokv.cache.hashing`."""

REMOTE_URL_SCHEMES = ("redis", "rediss", "unix")
"""URL schemes of `KVCacheParams.remote_kvcache_url` (those of redis-py's `from_url`)."""

REMOTE_NAMESPACE = re.compile(r"[A-Za-z0-9._/@+-]{1,200}")
"""A `remote_kvcache_namespace`: no ':' or spaces, so that no two keys are ambiguous."""


@dataclass(frozen=True)
class KVCacheParams:
    """The shape of the cache and the features a manager turns on.

    Attributes:
        dtype: element type of the cached keys and values.
        n_kv_heads: key/value heads of the model (all devices together).
        head_dim: size of one head's key or value vector.
        page_size: tokens per page of the paged cache.
        cache_strategy: `KVCacheStrategy.PAGED` or `KVCacheStrategy.CONTINUOUS`: the
            manager `load_kv_manager` builds (a manager built directly is its own layout).
        enable_prefix_caching: share full pages between requests whose token
            prefixes are identical (paged strategy only).
        enable_kvcache_swapping_to_host: keep copies of committed pages in a host-memory
            tier, so that prefixes evicted from the device are loaded back instead of
            recomputed (paged strategy with `enable_prefix_caching`; see README "Host tier").
        host_kvcache_swap_space_gb: size of that host tier in GiB, all replicas together
            (required, > 0, with the tier on).
        host_kvcache_min_hits: write a page through to the host tier only once it was hit
            this many times on the device (0, the default: every committed page at once).
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
        remote_kvcache_url: a `redis://host:port/db` (or `rediss://`, `unix://`) URL of a
            Redis server that several managers share as a page store behind the device
            and host tiers (None, the default: no shared tier; see README "Shared tier").
            Needs `enable_prefix_caching` and a stable `prefix_hash`.
        remote_kvcache_namespace: the model's name in that store (required with a URL):
            only managers with the same namespace, layout and hash seed share pages.
        remote_kvcache_timeout_s: bound on each connect and each reply of the store (a
            slower server is a miss).
    """

    dtype: DType
    n_kv_heads: int
    head_dim: int
    page_size: int = 128
    cache_strategy: KVCacheStrategy = KVCacheStrategy.PAGED
    enable_prefix_caching: bool = False
    enable_kvcache_swapping_to_host: bool = False
    host_kvcache_swap_space_gb: float | None = None
    host_kvcache_min_hits: int = 0
    data_parallel_degree: int = 1
    n_devices: int = 1
    prefix_hash: str = "xxh3"
    prefix_hash_seed: int = 0
    remote_kvcache_url: str | None = None
    remote_kvcache_namespace: str | None = None
    remote_kvcache_timeout_s: float = 0.25

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            raise TypeError(f"dtype must be a max.dtype.DType, got {self.dtype!r}")
        if self.dtype not in CACHE_DTYPES:
            raise ValueError(
                f"dtype={self.dtype} is not a supported cache dtype; use one of "
                f"{[d.name for d in CACHE_DTYPES]}"
            )
        for name in ("n_kv_heads", "head_dim", "page_size", "data_parallel_degree", "n_devices"):
            value = getattr(self, name)
            if value.__class__ is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        # Accept the enum's string value too ("paged"), as configs often come from text.
        object.__setattr__(self, "cache_strategy", KVCacheStrategy(self.cache_strategy))
        if self.n_devices % self.data_parallel_degree:
            raise ValueError(
                f"n_devices={self.n_devices} is not a multiple of "
                f"data_parallel_degree={self.data_parallel_degree}"
            )
        if self.n_kv_heads % self.tensor_parallel_degree:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} cannot be split evenly across the "
                f"{self.tensor_parallel_degree} devices of a replica"
            )
        if self.enable_kvcache_swapping_to_host:
            gb = self.host_kvcache_swap_space_gb
            if gb.__class__ not in (int, float) or not gb > 0:
                raise ValueError(
                    "enable_kvcache_swapping_to_host needs host_kvcache_swap_space_gb > 0, "
                    f"got {gb!r}"
                )
            if self.host_kvcache_min_hits.__class__ is not int or self.host_kvcache_min_hits < 0:
                raise ValueError(
                    f"host_kvcache_min_hits must be an int >= 0, got {self.host_kvcache_min_hits!r}"
                )
            if not self.enable_prefix_caching:
                raise ValueError(
                    "enable_kvcache_swapping_to_host needs enable_prefix_caching: the host "
                    "tier holds committed prefix pages"
                )
        if self.prefix_hash not in PREFIX_HASH_ALGORITHMS:
            raise ValueError(
                f"prefix_hash={self.prefix_hash!r} is not one of {PREFIX_HASH_ALGORITHMS}"
            )
        if self.remote_kvcache_url is not None:
            self._check_remote()

    def _check_remote(self) -> None:
        url, namespace = self.remote_kvcache_url, self.remote_kvcache_namespace
        if not isinstance(url, str) or url.partition("://")[0] not in REMOTE_URL_SCHEMES:
            raise ValueError(
                f"remote_kvcache_url must be a {'/'.join(REMOTE_URL_SCHEMES)}:// URL, got {url!r}"
            )
        if not isinstance(namespace, str) or not REMOTE_NAMESPACE.fullmatch(namespace):
            raise ValueError(
                "remote_kvcache_namespace must be 1-200 characters of [A-Za-z0-9._/@+-] "
                f"(the model's name in the shared store), got {namespace!r}"
            )
        timeout = self.remote_kvcache_timeout_s
        if timeout.__class__ not in (int, float) or not timeout > 0:
            raise ValueError(f"remote_kvcache_timeout_s must be > 0, got {timeout!r}")
        if not self.enable_prefix_caching:
            raise ValueError(
                "remote_kvcache_url needs enable_prefix_caching: the shared tier holds "
                "committed prefix pages"
            )
        if self.prefix_hash == "builtin":
            raise ValueError(
                "remote_kvcache_url needs a stable prefix_hash ('xxh3' or 'sha256'): "
                "'builtin' differs between processes, so nothing could be shared"
            )

    @property
    def tensor_parallel_degree(self) -> int:
        """Devices per replica; the KV heads are split across them."""
        return self.n_devices // self.data_parallel_degree

    @property
    def n_kv_heads_per_device(self) -> int:
        """KV heads stored on each device of a replica."""
        return self.n_kv_heads // self.tensor_parallel_degree

    def bytes_per_token(self, num_layers: int) -> int:
        """Bytes of K and V that one token occupies in one replica (all its devices).

        `2 (K and V) * num_layers * n_kv_heads * head_dim * dtype size`.
        """
        return 2 * num_layers * self.n_kv_heads * self.head_dim * self.dtype.size_in_bytes

    def bytes_per_page(self, num_layers: int) -> int:
        """Bytes of one page in one replica: `page_size * bytes_per_token(num_layers)`."""
        return self.page_size * self.bytes_per_token(num_layers)
