"""The shared tier: pages on a Redis (or Valkey) server that several managers share, over
`mokv.remote` (README "Shared tier").

    KVCacheParams(..., enable_prefix_caching=True,
                  tiers=(RemoteTierConfig(url="redis://10.0.0.5:6379/0",
                                          namespace="llama-3.2-1b"),))

Each replica opens one `RemotePageStore` per device shard (its layout names the shard);
nothing is sent before the first request.

- `store` queues every page the device newly indexed to each shard's store (a copy; the
  writer threads send it, the scheduler never waits for the server). Pages loaded from
  the store are not written back to it.
- `lookup` asks each shard's store for the chain (one `lookup` per shard, each for no
  more pages than the shards before it returned): a page counts only if every shard
  holds it. The validated bytes ride in the hits, so there is nothing to pin, and
  `load` copies them into the device pages (one pass per shard).
- A failing server is a miss, never an error or a wrong page (see `RemotePageStore`).
- Events: the pages every shard queued are announced with medium "EXTERNAL"; evictions
  never are (the server evicts by itself).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar
from urllib.parse import unquote, urlsplit

import numpy as np
import redis
from max.driver import Buffer

from ..cache.hashing import STABLE_ALGORITHMS
from ..cache.page_copy import read_pages, write_pages
from ..cache.page_pool import PageEventSink, PagePool
from ..errors import InvariantError
from ..events.format import MEDIUM_SHARED
from ..events.publisher import EventRecorder
from ..metrics import TierMetrics
from ..params import KVCacheParams
from ..remote import PageCodec, RemoteLayout, RemoteMetrics, RemotePageStore
from ..remote.codec import mac_key_bytes
from ..remote.layout import REMOTE_NAMESPACE
from ..remote.store import MAX_TIMEOUT_S
from ..undo import UndoLog
from .base import CommittedPages, DeviceHit, TierConfig, TierHit

REMOTE_URL_SCHEMES = ("redis", "rediss", "unix")
"""URL schemes of `RemoteTierConfig.url` (those of redis-py's `from_url`)."""

REMOTE_QUEUE_BYTES = 256 * 2**20
"""Most value bytes one shard's store holds queued for its writer before it drops pages:
a page count alone would let large pages (4 MiB at Llama-3.2-1B's bf16 page of 128)
queue a GiB per shard behind a slow server."""


@dataclass(frozen=True)
class RemoteTierConfig(TierConfig):
    """Share committed pages through a Redis server (paged strategy; needs
    `enable_prefix_caching` and a stable `prefix_hash`).

    Attributes:
        url: `redis://host:port/db`, `rediss://` (TLS) or `unix://`.
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
    url: str
    namespace: str
    timeout_s: float = 0.25
    mac_key: bytes | str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
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
            f"RemoteTierConfig(url={redacted_url(self.url)!r}, namespace={self.namespace!r}, "
            f"timeout_s={self.timeout_s!r})"
        )

    def check(self, params: KVCacheParams) -> None:
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

    def build(
        self, params: KVCacheParams, num_layers: int, pool: PagePool, blocks: list[Buffer]
    ) -> RemoteTier:
        layouts = [
            RemoteLayout.from_params(params, num_layers, shard) for shard in range(len(blocks))
        ]
        return RemoteTier(self, layouts, blocks)


def check_url(url: object) -> None:
    """ValueError naming `url` unless it is a Redis URL that redis-py connects to as
    written: `redis://` or `rediss://` with a host, a port in 1-65535 and a numeric
    database, or `unix://` with the socket's path. The error shows the URL without its
    passwords (`redacted_url`): error messages end up in logs."""
    if not isinstance(url, str):
        raise ValueError(
            f"RemoteTierConfig.url must be a {'/'.join(REMOTE_URL_SCHEMES)}:// URL (a str), "
            f"got {type(url).__name__}"
        )
    problem = _url_problem(url)
    if problem is not None:
        for secret in url_secrets(url):  # redis-py's own message may quote a setting
            problem = problem.replace(secret, "***")
        raise ValueError(f"RemoteTierConfig.url={redacted_url(url)!r}: {problem}")


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


class RemoteTier:
    """One replica's view of the shared store: `stores[d]` holds device shard `d`."""

    name = RemoteTierConfig.name
    shared = True
    # Nothing of its own to undo: the hits carry their bytes, stored pages are the
    # server's (valid pages), and its announcements are the event recorder's.
    undo: UndoLog | None = None

    def __init__(
        self, config: RemoteTierConfig, layouts: list[RemoteLayout], blocks: list[Buffer]
    ) -> None:
        self.stores: list[RemotePageStore] = []
        try:
            for layout in layouts:
                value_nbytes = PageCodec(layout, config.namespace, config.mac_key).value_nbytes
                self.stores.append(
                    RemotePageStore(
                        config.url,
                        config.namespace,
                        layout,
                        mac_key=config.mac_key,
                        timeout_s=config.timeout_s,
                        max_queued_pages=max(8, REMOTE_QUEUE_BYTES // value_nbytes),
                    )
                )
        except BaseException:
            self.close()  # each store runs a writer thread
            raise
        self._blocks = blocks
        self._views: dict[int, np.ndarray] = {}  # numpy views of the blocks, by buffer id
        self._bytes_loaded = 0
        self._events: PageEventSink | None = None

    def store_metrics(self) -> RemoteMetrics:
        """The stores' own counters, summed over the shards (each counts its pages)."""
        return sum((store.metrics for store in self.stores), RemoteMetrics())

    # --- reads ----------------------------------------------------------------------

    def lookup(self, chain: Iterator[tuple[int, bytes]]) -> list[TierHit]:
        pages = list(chain)
        shards: list[list[memoryview]] = []
        found = len(pages)
        for store in self.stores:
            shards.append(store.lookup(pages, found) if found else [])
            found = len(shards[-1])
        return [
            TierHit(page_hash, data, tuple(shard[i] for shard in shards))
            for i, (page_hash, data) in enumerate(pages[:found])
        ]

    def pin(self, hits: Sequence[TierHit]) -> None:
        """Nothing to pin: the hits carry their bytes."""

    def unpin(self, hits: Sequence[TierHit]) -> None:
        """Nothing was pinned."""

    def load(self, hits: Sequence[TierHit], device_pages: Sequence[int]) -> None:
        for shard, block in enumerate(self._blocks):
            write_pages([hit.handle[shard] for hit in hits], block, device_pages, self._views)
        self._bytes_loaded += sum(page.nbytes for hit in hits for page in hit.handle)

    def note_reserved(
        self, fresh_pages: Sequence[int], device_hits: Sequence[Sequence[DeviceHit]]
    ) -> None:
        """Nothing to refresh: the server keeps its own LRU."""

    # --- writes ---------------------------------------------------------------------

    def store(self, pages: CommittedPages) -> None:
        """Queues the pages to each shard's store. `put` copies the bytes and never
        blocks or raises for the server: a full queue drops the page (counted). Pages
        every shard queued are announced to the replica's events (medium "EXTERNAL")."""
        if not pages.page_ids:
            return
        queued = [True] * len(pages.page_ids)
        for store, block in zip(self.stores, self._blocks):
            for i, (page_hash, data, page) in enumerate(
                zip(pages.hashes, pages.token_bytes, read_pages(block, pages.page_ids, self._views))
            ):
                queued[i] &= store.put(page_hash, data, page)
        if self._events is not None:
            for i, ok in enumerate(queued):
                if ok:
                    self._events.stored(
                        pages.hashes[i], pages.parents[i], pages.token_bytes[i], pages.keys[i]
                    )

    # --- the rest of the protocol ---------------------------------------------------

    def reset(self) -> None:
        """Nothing: the store is shared, not this replica's to clear."""

    def close(self) -> None:
        """Sends the queued pages (a bounded wait per store) and disconnects."""
        for store in self.stores:
            store.close()

    def publish_to(self, events: EventRecorder) -> None:
        """Announces the pages this replica queued to the store, with medium "EXTERNAL".
        Never a removal: the server evicts by itself and tells no one (a router's view of
        the shared tier may hold pages already gone). Loaded pages are announced as the
        device indexes them."""
        self._events = events.medium_sink(MEDIUM_SHARED)

    def metrics(self) -> TierMetrics:
        """The bytes loaded; what the writer threads sent is `store_metrics()`."""
        return TierMetrics(bytes_loaded=self._bytes_loaded)

    def reset_metrics(self) -> None:
        """Zeroes the bytes loaded; the stores' own counters only grow."""
        self._bytes_loaded = 0

    def retain(self, page_hashes: Sequence[int]) -> None:
        """Nothing: the server evicts by itself (sessions cannot hold its pages)."""

    def unretain(self, page_hashes: Sequence[int], old_end: bool) -> None:
        """Nothing was retained."""

    def check_invariants(self, pinned: Sequence[TierHit]) -> None:
        for hit in pinned:
            if len(hit.handle) != len(self.stores):
                raise InvariantError(
                    f"a pending remote load of page {hit.page_hash} carries "
                    f"{len(hit.handle)} shards for {len(self.stores)} stores"
                )
