"""The tiers' configurations: entries of `KVCacheParams.tiers`.

A tier is one config here (a frozen dataclass whose `__post_init__` checks its fields
and whose `check` checks it against the params it joins) and one class in `mokv.tiers`
built from it through the registry (`mokv.registry`). Nothing here imports a tier: the
configs sit on the ground floor (`mokv.config`).
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar
from urllib.parse import unquote, urlsplit

import redis

from ..errors import InsufficientMemoryError
from .base import STABLE_ALGORITHMS, ParamsView

MIN_MAC_KEY_BYTES = 16
"""The shortest `RemoteTierConfig.mac_key`."""

REMOTE_NAMESPACE = re.compile(r"[A-Za-z0-9._/@+-]{1,200}")
"""A namespace of the shared store: no ':' or spaces, so that no two keys are ambiguous."""

REMOTE_URL_SCHEMES = ("redis", "rediss", "unix")
"""URL schemes of `RemoteTierConfig.url` (those of redis-py's `from_url`)."""

MAX_TIMEOUT_S = 60.0
"""Longest `RemoteTierConfig.timeout_s` (and a `RemotePageStore`'s): the shared tier is
asked inside `maybe_reserve`, so a slower reply stalls every request of the step, and a
miss only costs a recompute. (Python's sockets refuse timeouts past ~2**63 ns: 1e12 s
broke every lookup with an OverflowError.)"""


class TierConfig(ABC):
    """The configuration of one cache tier: an entry of `KVCacheParams.tiers`."""

    name: ClassVar[str]
    """The tier's name in `KVCacheMetrics.tiers` (one tier of each name per params)."""

    @abstractmethod
    def check(self, params: ParamsView) -> None:
        """ValueError naming the setting when `params` cannot carry this tier (called
        by `KVCacheParams.__post_init__`)."""


MAX_SWAP_SPACE_GB = 2**16
"""64 TiB: more host memory than any one machine has (the largest hold tens of TiB)."""


@dataclass(frozen=True)
class HostTierConfig(TierConfig):
    """Keep copies of committed pages in host memory (paged strategy; needs
    `enable_prefix_caching`).

    Attributes:
        swap_space_gb: GiB of host memory for the tier, all replicas together (> 0 and
            at most `MAX_SWAP_SPACE_GB`; a manager also refuses more than its machine's
            memory).
        min_hits: write a page through only once it was hit this many times on the
            device (0, the default: every committed page at once).
    """

    name: ClassVar[str] = "host"
    swap_space_gb: float
    min_hits: int = 0

    def __post_init__(self) -> None:
        gb = self.swap_space_gb
        if gb.__class__ not in (int, float) or not 0 < gb < math.inf:
            raise ValueError(
                f"HostTierConfig.swap_space_gb must be a finite number of GiB > 0, got {gb!r}"
            )
        if gb > MAX_SWAP_SPACE_GB:
            raise InsufficientMemoryError(
                f"HostTierConfig.swap_space_gb={gb!r} is more than any machine's memory "
                f"(at most {MAX_SWAP_SPACE_GB} GiB)"
            )
        if self.min_hits.__class__ is not int or self.min_hits < 0:
            raise ValueError(f"HostTierConfig.min_hits must be an int >= 0, got {self.min_hits!r}")

    def check(self, params: ParamsView) -> None:
        if not params.enable_prefix_caching:
            raise ValueError(
                "HostTierConfig needs enable_prefix_caching: the host tier holds committed "
                "prefix pages"
            )

    def num_pages(self, params: ParamsView, num_layers: int) -> int:
        """Host pages of one replica; InsufficientMemoryError if that is none."""
        page_bytes = params.bytes_per_page(num_layers)
        num = int(self.swap_space_gb * 2**30) // params.data_parallel_degree // page_bytes
        if num < 1:
            raise InsufficientMemoryError(
                f"HostTierConfig.swap_space_gb={self.swap_space_gb} holds no page of "
                f"{page_bytes} bytes per replica"
            )
        return num


@dataclass(frozen=True)
class RemoteTierConfig(TierConfig):
    """Share committed pages through a Redis server or a Redis Cluster (paged strategy;
    needs `enable_prefix_caching` and a stable `prefix_hash`).

    Attributes:
        url: one server: `redis://host:port/db`, `rediss://` (TLS) or `unix://`; a
            Redis Cluster: a tuple (or list, kept as a tuple) of its seed nodes'
            `redis://host:port` (or `rediss://`) URLs, one at least (the other nodes
            are found through them).
        namespace: the model's name in the store, 1-200 characters of
            `[A-Za-z0-9._/@+-]`: only managers with the same namespace, page layout and
            `prefix_hash_seed` share pages.
        timeout_s: bound on each connect and each reply (a slower server is a miss), in
            seconds: at most `MAX_TIMEOUT_S` (60).
        mac_key: a secret the servers share (bytes, or a str; at least 16 bytes): every
            value is sealed with an HMAC-SHA256 tag and served only if its tag is
            right, so that whoever can write the Redis server but lacks the key cannot
            plant pages (`mokv.remote.codec`). None (the default): no tag, and the
            server must be trusted. Servers with different keys share nothing; it is
            never shown in a repr or an error, nor is a password in `url`.
    """

    name: ClassVar[str] = "remote"
    url: str | tuple[str, ...]
    namespace: str
    timeout_s: float = 0.25
    mac_key: bytes | str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.url, list):  # a YAML file's (`mokv serve --mokv-config`)
            object.__setattr__(self, "url", tuple(self.url))
        if isinstance(self.url, tuple):
            check_cluster_urls(self.url)
        else:
            check_url(self.url)
        if not isinstance(self.namespace, str) or not REMOTE_NAMESPACE.fullmatch(self.namespace):
            raise ValueError(
                "RemoteTierConfig.namespace must be 1-200 characters of [A-Za-z0-9._/@+-] "
                f"(the model's name in the shared store), got {self.namespace!r}"
            )
        timeout = self.timeout_s
        if timeout.__class__ not in (int, float) or not 0 < timeout <= MAX_TIMEOUT_S:
            raise ValueError(
                f"RemoteTierConfig.timeout_s must be a number of seconds in (0, "
                f"{MAX_TIMEOUT_S:g}], got {timeout!r}"
            )
        mac_key_bytes(self.mac_key, "RemoteTierConfig.mac_key")

    def __repr__(self) -> str:
        """The fields but the secrets: the URL's passwords shown as `***`, no MAC key."""
        return (
            f"RemoteTierConfig(url={redacted_urls(self.url)!r}, namespace={self.namespace!r}, "
            f"timeout_s={self.timeout_s!r})"
        )

    def check(self, params: ParamsView) -> None:
        if not params.enable_prefix_caching:
            raise ValueError(
                "RemoteTierConfig needs enable_prefix_caching: the shared tier holds "
                "committed prefix pages"
            )
        if params.prefix_hash not in STABLE_ALGORITHMS:
            raise ValueError(
                f"RemoteTierConfig needs a stable prefix_hash {STABLE_ALGORITHMS}: "
                f"{params.prefix_hash!r} differs between processes, so nothing could be shared"
            )


def check_url(url: object) -> None:
    """ValueError naming `url` unless it is a Redis URL that redis-py connects to as
    written: `redis://` or `rediss://` with a host, a port in 1-65535 and a numeric
    database, or `unix://` with the socket's path. The error shows the URL without its
    passwords (`redacted_url`): error messages end up in logs."""
    if not isinstance(url, str):
        raise ValueError(
            f"RemoteTierConfig.url must be a {'/'.join(REMOTE_URL_SCHEMES)}:// URL (a str) "
            f"or a tuple of a Redis Cluster's seed URLs, got {type(url).__name__}"
        )
    problem = _url_problem(url)
    if problem is not None:
        for secret in url_secrets(url):  # redis-py's own message may quote a setting
            problem = problem.replace(secret, "***")
        raise ValueError(f"RemoteTierConfig.url={redacted_url(url)!r}: {problem}")


def check_cluster_urls(urls: tuple) -> None:
    """ValueError naming the URL unless `urls` are one or more distinct `redis://` or
    `rediss://` URLs of database 0 (`check_url`): a cluster has no unix sockets and no
    other database."""
    if not urls:
        raise ValueError("RemoteTierConfig.url: a Redis Cluster needs one seed node's URL at least")
    for url in urls:
        check_url(url)
        parts = urlsplit(url)
        if parts.scheme == "unix" or parts.path.strip("/") not in ("", "0"):
            raise ValueError(
                f"RemoteTierConfig.url: a Redis Cluster's seed {redacted_url(url)!r} must be "
                "a redis:// or rediss:// URL of database 0"
            )
    if len(set(urls)) != len(urls):
        raise ValueError(
            f"RemoteTierConfig.url: a Redis Cluster's seeds repeat, {redacted_urls(urls)!r}"
        )


def _url_problem(url: str) -> str | None:
    """What keeps redis-py from connecting to `url` as written, or None."""
    if url.partition("://")[0] not in REMOTE_URL_SCHEMES:
        return f"not a {'/'.join(REMOTE_URL_SCHEMES)}:// URL"
    try:
        parts = urlsplit(url)
    except ValueError as e:  # an unbalanced IPv6 bracket
        return str(e)
    try:
        port = parts.port  # None: redis-py's default
    except ValueError:
        port = 0
    db = parts.path.strip("/")
    if parts.scheme == "unix":
        if not parts.path:
            return "a unix:// URL names the socket's path"
    elif not parts.hostname:
        return "no host"
    elif port == 0:
        return "the port is not a number in 1-65535"
    elif db and not (db.isascii() and db.isdigit()):
        return f"the database {db!r} is not a number"
    try:
        redis.connection.parse_url(url)  # the query's options, as redis-py reads them
    except ValueError as e:
        return str(e)
    return None


_USERINFO_PASSWORD = re.compile(r"(?<=://)([^/?#@]*?):([^/?#]*)@")
_QUERY_PASSWORD = re.compile(r"([?&;]password=)([^&;#]*)", re.IGNORECASE)


def url_secrets(url: str) -> list[str]:
    """The passwords `url` carries (in its user info, in a `password=` query option), as
    written and percent-decoded, longest first."""
    found = [m.group(2) for m in _USERINFO_PASSWORD.finditer(url)]
    found += [m.group(2) for m in _QUERY_PASSWORD.finditer(url)]
    secrets = {s for raw in found if raw for s in (raw, unquote(raw))}
    return sorted(secrets, key=len, reverse=True)


def redacted_url(url: object) -> str:
    """`url` as errors and reprs show it: each password (user info, `password=` query
    option) replaced by `***`; a URL that is not a str shows its type only."""
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    url = _USERINFO_PASSWORD.sub(r"\1:***@", url)
    return _QUERY_PASSWORD.sub(r"\1***", url)


def redacted_urls(url: object) -> str | tuple[str, ...]:
    """`redacted_url` of a URL, or of each URL of a cluster's tuple."""
    if isinstance(url, tuple):
        return tuple(redacted_url(u) for u in url)
    return redacted_url(url)


def mac_key_bytes(mac_key: bytes | str | None, name: str = "mac_key") -> bytes | None:
    """`mac_key` as bytes (a str is UTF-8), or None. TypeError / ValueError naming the
    setting, never the secret: at least 16 bytes."""
    if mac_key is None:
        return None
    if isinstance(mac_key, str):
        mac_key = mac_key.encode()
    if not isinstance(mac_key, bytes):
        raise TypeError(f"{name} must be bytes, a str or None, got {type(mac_key).__name__}")
    if len(mac_key) < MIN_MAC_KEY_BYTES:
        raise ValueError(
            f"{name} must be at least {MIN_MAC_KEY_BYTES} bytes (a secret the servers "
            f"share), got {len(mac_key)}"
        )
    return mac_key
