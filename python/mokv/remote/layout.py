"""What a remote page is: its layout, its fingerprint and its Redis key. Its value's
bytes are `codec.py`'s.

Key (readable, so an operator can `redis-cli --scan --pattern 'mokv:v4:<namespace>:*'`):

    mokv:v4:{namespace}:{fingerprint}[.mac-{key id}]:{page hash as 16 hex digits}
    fingerprint = {dtype}.p{page_size}.l{layers}.h{kv heads per device}.d{head_dim}
                  [.s{scales per head}f32].tp{rank}-{degree}.{group}.{prefix hash
                  algorithm}
    e.g. mokv:v4:llama-3.2-1b:bfloat16.p128.l16.h8.d64.tp0-1.full.xxh3:9f0c1e2d3a4b5c6d
    group = "full" or "mla" for a cache of one group; in a cache of several, each
            group's own (`group_key`: kind, window, index), e.g. "sliding_window-w1024-g0"

Scaled FP8 pages (`KVCacheParams.quantization`) store their scales with their values:
the page's bytes are the values' (`page_shape`) and then the scales'
(`scales_shape`, float32), and their fingerprint names the scales per head
(`.s1f32` for heads of 128 lanes at MAX's granularity). Unscaled FP8 pages have no `.s`
part; their dtype tells them apart.

The fingerprint is the cache layout: two servers whose pages differ in any of dtype,
page size, layers, heads, head_dim, shard, group kind or hash scheme write and read
disjoint keys, and each value names its key prefix (the codec's key space digest), so a
value copied under another layout's key is refused too. `v4` names the key and value
format (the codec's `VERSION` is its value half).

The page hash is mokv's chained page hash (`mokv.cache.hashing`): stable across
processes and machines, and it already includes the cache salt and the hash seed, so
two tenants with different salts never share a key. Servers that seal their values
with a MAC key (`RemoteTierConfig.mac_key`) use keys of their own, named by a keyed
digest of that key (`codec.mac_key_id`): they never read another key's values, and a
new key starts an empty key space (v1 was the format before values named their key
space, issue 41).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from max.dtype import DType

from ..config.base import CACHE_DTYPES, PREFIX_HASH_ALGORITHMS
from ..config.params import KVCacheParams
from ..config.quantization import QUANTIZED_DTYPES
from ..config.recurrent import STATE_REGION_ID, StateRegion
from ..config.tiers import REMOTE_NAMESPACE

KEY_PREFIX = "mokv:v4"  # v4: the fingerprint names the group kind (v3: keys digest)
DTYPE_CODES = {DType.float32: 1, DType.bfloat16: 2, DType.float16: 3, DType.float8_e4m3fn: 4}
assert set(DTYPE_CODES) == {*CACHE_DTYPES, *QUANTIZED_DTYPES}
SCALE_DTYPE = DType.float32
"""The dtype of a scaled page's scales (the one `KVCacheQuantization` stores)."""
GROUP_KIND = re.compile(r"[a-z][a-z0-9_-]{0,63}")
"""A group kind in a fingerprint: a lowercase name, with its own parameters after a '-'
(e.g. a sliding window's size), never a '.' or ':' that would make keys ambiguous."""
FULL_ATTENTION = "full"
"""The group kind of a paged manager's pages: every token's keys and values, kept."""
MLA = "mla"
"""The group kind of an MLA cache's pages: every token's latent, kept."""


def group_key(kind: str, index: int, window_size: int | None) -> str:
    """The `group` of the layout of a cache of several groups: the group's kind, its
    window (tokens) and its index, e.g. "sliding_window-w1024-g0", "full-g1", "mla-g0".
    Two groups of a model may share a head shape and layer count (then only the index
    tells their pages apart), and a full and a sliding group hold different tokens of a
    page's hash (a window's page is only what its layers wrote)."""
    window = "" if window_size is None else f"-w{window_size}"
    return f"{kind}{window}-g{index}"


@dataclass(frozen=True)
class RemoteLayout:
    """The shape of one stored page: everything two servers must agree on to share it.

    One layout per device shard: with tensor parallelism each device stores its own
    heads under its own `tp_rank`. `group` is the kind of cache group the pages belong
    to (`FULL_ATTENTION`: a paged manager's; another kind's pages hold other tokens
    under the same hashes, so they must never be read for these); in a cache of several
    groups, the group itself (`group_key`: kind, window and index).
    """

    dtype: DType
    page_size: int
    num_layers: int
    n_kv_heads_per_device: int
    head_dim: int
    tp_rank: int = 0
    tp_degree: int = 1
    prefix_hash: str = "xxh3"
    group: str = FULL_ATTENTION
    kv_dim: int = 2
    """2 (K and V), or 1 (an MLA latent, whole on every shard: group "mla")."""
    scales_per_head: int = 0
    """float32 scales of each head of a token (scaled FP8 pages); 0: no scales."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype={self.dtype!r} is not a cache dtype {list(DTYPE_CODES)}")
        if self.kv_dim not in (1, 2):
            raise ValueError(
                f"kv_dim must be 1 (an MLA latent) or 2 (K and V), got {self.kv_dim!r}"
            )
        for name in ("page_size", "num_layers", "n_kv_heads_per_device", "head_dim", "tp_degree"):
            value = getattr(self, name)
            if value.__class__ is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        sph = self.scales_per_head
        if sph.__class__ is not int or sph < 0 or (sph and self.dtype not in QUANTIZED_DTYPES):
            raise ValueError(
                f"scales_per_head must be an int >= 0, and 0 but for {QUANTIZED_DTYPES} "
                f"pages, got {sph!r} for dtype={self.dtype}"
            )
        if self.tp_rank.__class__ is not int or not 0 <= self.tp_rank < self.tp_degree:
            raise ValueError(f"tp_rank must be in [0, {self.tp_degree}), got {self.tp_rank!r}")
        if self.prefix_hash not in PREFIX_HASH_ALGORITHMS or self.prefix_hash == "builtin":
            # Python's builtin hash differs between processes: nothing could be shared.
            raise ValueError(
                f"prefix_hash={self.prefix_hash!r}: a shared tier needs a stable hash "
                "('xxh3' or 'sha256')"
            )
        if not isinstance(self.group, str) or not GROUP_KIND.fullmatch(self.group):
            raise ValueError(
                f"group={self.group!r} is not a group kind (a lowercase name such as "
                f"{FULL_ATTENTION!r}, of [a-z0-9_-])"
            )

    @classmethod
    def from_params(
        cls, params: KVCacheParams, num_layers: int, tp_rank: int = 0, group: str | None = None
    ):
        """The layout of device `tp_rank`'s shard of a replica built from `params` (of
        one group's pages, `params.group_params`, named `group`: `group_key`; None: the
        one group of a cache of one, "full" or "mla")."""
        if group is None:
            group = FULL_ATTENTION if params.mla_group is None else MLA
        return cls(
            params.dtype,
            params.page_size,
            num_layers,
            params.n_kv_heads_per_device,
            params.head_dim,
            tp_rank,
            params.tensor_parallel_degree,
            params.prefix_hash,
            group=group,
            kv_dim=params.kv_dim,
            scales_per_head=params.scales_per_head,
        )

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """`[kv_dim, layers, page_size, kv heads per device, head_dim]`: one device page."""
        return (
            self.kv_dim,
            self.num_layers,
            self.page_size,
            self.n_kv_heads_per_device,
            self.head_dim,
        )

    @property
    def scales_shape(self) -> tuple[int, int, int, int, int]:
        """`[kv_dim, layers, page_size, kv heads per device, scales_per_head]`: one device
        page's scales (a zero dim without scales)."""
        return (
            self.kv_dim,
            self.num_layers,
            self.page_size,
            self.n_kv_heads_per_device,
            self.scales_per_head,
        )

    @cached_property
    def values_nbytes(self) -> int:
        """Bytes of one page's values: the first part of its bytes."""
        n = self.dtype.size_in_bytes
        for dim in self.page_shape:
            n *= dim
        return n

    @cached_property
    def page_nbytes(self) -> int:
        """Bytes of one page: its values and then its scales."""
        n = SCALE_DTYPE.size_in_bytes
        for dim in self.scales_shape:
            n *= dim
        return self.values_nbytes + n

    @property
    def dtype_code(self) -> int:
        """The value header's dtype code (`codec.py`)."""
        return DTYPE_CODES[self.dtype]

    @property
    def header_shape(self) -> tuple[int, ...]:
        """The value header's shape: `page_shape`."""
        return self.page_shape

    @cached_property
    def fingerprint(self) -> str:
        scales = f".s{self.scales_per_head}f32" if self.scales_per_head else ""
        return (
            f"{self.dtype.name}.p{self.page_size}.l{self.num_layers}"
            f".h{self.n_kv_heads_per_device}.d{self.head_dim}{scales}"
            f".tp{self.tp_rank}-{self.tp_degree}.{self.group}.{self.prefix_hash}"
        )

    def key_prefix(self, namespace: str, key_id: str | None = None) -> str:
        """`mokv:v4:{namespace}:{fingerprint}:`, or `...{fingerprint}.mac-{key_id}:` for
        values sealed with a MAC key (`codec.PageCodec`); ValueError for a namespace
        that could make two keys ambiguous (empty, too long, or with ':' or spaces)."""
        return key_prefix(namespace, self.fingerprint, key_id)


def key_prefix(namespace: str, fingerprint: str, key_id: str | None) -> str:
    """The keys of a namespace and layout fingerprint (`RemoteLayout.key_prefix`)."""
    if not isinstance(namespace, str) or not REMOTE_NAMESPACE.fullmatch(namespace):
        raise ValueError(
            f"namespace must be 1-200 characters of [A-Za-z0-9._/@+-], got {namespace!r}"
        )
    mac = "" if key_id is None else f".mac-{key_id}"
    return f"{KEY_PREFIX}:{namespace}:{fingerprint}{mac}:"


STATE = "state"
"""A recurrent state's checkpoints' fingerprints start with it (no dtype is called so)."""


@dataclass(frozen=True)
class StateLayout:
    """The shape of one stored checkpoint of a recurrent state (`KVCacheParams.recurrent`)
    on one device shard: everything two servers must agree on to share it. Its value is
    the shard's state, region after region (`StateRegion`: `[num_layers, *row_shape]`
    of its dtype), stored under the chain hash and tokens of its boundary page.

    The fingerprint names every region's id, layers, row shape and dtype, the page size
    (the tokens of a boundary), the shard and the hash scheme, e.g.
    `state.p128.conv-l48-8192x3-bfloat16+ssm-l48-16x128x128-float32.tp0-1.xxh3`: two
    caches whose states differ in any of them write and read disjoint keys.
    """

    regions: tuple[StateRegion, ...]
    page_size: int
    tp_rank: int = 0
    tp_degree: int = 1
    prefix_hash: str = "xxh3"
    dtype_code: ClassVar[int] = 0
    """The value header's dtype code: a checkpoint's (its regions name their dtypes)."""

    def __post_init__(self) -> None:
        for region in self.regions:
            if not STATE_REGION_ID.fullmatch(region.leaf_id):
                raise ValueError(
                    f"state region {region.leaf_id!r}: a shared tier's keys need region ids "
                    "of 1-64 characters of [A-Za-z0-9_]"
                )
        for name in ("page_size", "tp_degree"):
            value = getattr(self, name)
            if value.__class__ is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.tp_rank.__class__ is not int or not 0 <= self.tp_rank < self.tp_degree:
            raise ValueError(f"tp_rank must be in [0, {self.tp_degree}), got {self.tp_rank!r}")
        if self.prefix_hash not in PREFIX_HASH_ALGORITHMS or self.prefix_hash == "builtin":
            raise ValueError(
                f"prefix_hash={self.prefix_hash!r}: a shared tier needs a stable hash "
                "('xxh3' or 'sha256')"
            )

    @property
    def header_shape(self) -> tuple[int, ...]:
        """The value header's shape: `[0, regions, page_size, tp rank, tp degree]` (a
        page's first dim is 1 or 2, so no page is read as a checkpoint)."""
        return (0, len(self.regions), self.page_size, self.tp_rank, self.tp_degree)

    @cached_property
    def page_nbytes(self) -> int:
        """Bytes of one shard's state (every region and layer)."""
        return sum(region.bytes_per_state for region in self.regions)

    @property
    def page_shape(self) -> tuple[int, ...]:
        """A checkpoint's bytes as one flat run (`codec.PageCodec.new_value`)."""
        return (self.page_nbytes,)

    @cached_property
    def fingerprint(self) -> str:
        regions = "+".join(
            f"{r.leaf_id}-l{r.num_layers}-{'x'.join(map(str, r.row_shape))}-{r.dtype.name}"
            for r in self.regions
        )
        return (
            f"{STATE}.p{self.page_size}.{regions}"
            f".tp{self.tp_rank}-{self.tp_degree}.{self.prefix_hash}"
        )

    def key_prefix(self, namespace: str, key_id: str | None = None) -> str:
        """`RemoteLayout.key_prefix` of this fingerprint."""
        return key_prefix(namespace, self.fingerprint, key_id)
