"""RemotePageStore: a content-addressed page store on Redis (one server, or a Redis
Cluster), shared by many servers.

What the manager's lookup chain calls (device -> host -> remote):

    put(page_hash, token_bytes, page)   copy the page and queue it; never blocks, never
                                        raises for a server problem; False if dropped
    probe(chain) / holds(hashes)        how many leading pages of the chain the server
                                        holds (one pipelined round trip; not validated)
    lookup(chain, max_pages)            the validated bytes of the leading pages the
                                        server holds: one round trip to probe, one more
                                        (MGET) to fetch the hits, then every value checked
    present(hashes) / get(hash, tokens) which of some pages the server holds (one
                                        pipelined EXISTS each) / one page's validated
                                        bytes (one GET): a recurrent state's checkpoints
    flush(timeout_s) / close()          wait for the queued writes / stop the writer

`chain` is an iterable of (page hash, the page's token ids as int64 little-endian bytes)
in chain order: exactly what `mokv.cache.hashing.iter_page_hashes` yields from where the
device and host tiers stop (only the first `max_pages` are read).

A page is one key (`codec.PageCodec.key`); on a Redis Cluster the pages spread over the
masters by their keys' hash slots, and each round trip is one pipeline per master
(`nodes.RedisNodes`).

Failure is a miss, never an error or a wrong page:
1. every round trip has a socket timeout (`timeout_s`) and is tried at most twice
   (a second time only for a dropped connection, e.g. a restarted server);
2. each server (each master of a cluster) has a `CircuitBreaker`, which stops its
   traffic after `failure_threshold` failed round trips in a row, for `cooldown_s`, then
   lets one trial through; a page on a server that failed, or that redirected (its
   slots moved in a failover), is a miss, and the other servers' pages are served;
3. a value is returned only if `PageCodec.decode` accepts it (checksum, layout, key
   space, page hash and token ids all exactly right, and the MAC tag with a `mac_key`);
   the first rejected or absent page ends the hits;
4. writes are SET NX: a stored page is never overwritten, so two servers writing the same
   page race harmlessly;
5. the writer thread owns the only other connection; callers never wait for it: a full
   queue drops the page and counts it.

Server-side eviction (`maxmemory-policy allkeys-lru`) just makes pages absent: misses.
Redis or socket errors are counted (`metrics`) and turned into misses; caller misuse
(a wrong page size, a non-int hash) raises ValueError before any I/O.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from itertools import islice

from ..config.tiers import MAX_TIMEOUT_S
from .breaker import CircuitBreaker
from .codec import PageCodec, Rejection
from .layout import RemoteLayout, StateLayout
from .nodes import NodeReplies, RedisNodes


@dataclass
class RemoteMetrics:
    """Counters of one store (read them any time; they only grow).

    Attributes:
        lookups: `lookup` calls (`probe` counts only in the round-trip counters).
        hits: pages `lookup` returned (validated).
        misses: lookups that ended before the pages asked for: an absent page, a
            rejected value, a failed round trip or an open breaker.
        rejected_corrupt / rejected_layout / rejected_keyspace / rejected_tokens /
            rejected_mac: values read but refused (see `codec.Rejection`); each is
            also a miss.
        bytes_read / bytes_written: value bytes moved each way.
        pages_written: pages stored (SET NX took); pages_present: pages the server
            already had (SET NX refused, harmless).
        errors / timeouts: failed round trips (a timeout is counted only as a timeout).
        drops: pages `put` could not queue (queue full, or the store closed).
        skipped: round trips not attempted because the breaker was open (reads), and
            pages discarded for the same reason (writes).
        redirects: commands a cluster node answered with a redirection (MOVED, ASK,
            CLUSTERDOWN, TRYAGAIN: its slots moved or are not served now); each is a
            miss, and the slot map is asked for again.
        breaker_trips: times a server's breaker opened.
    """

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    rejected_corrupt: int = 0
    rejected_layout: int = 0
    rejected_keyspace: int = 0
    rejected_tokens: int = 0
    rejected_mac: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    pages_written: int = 0
    pages_present: int = 0
    errors: int = 0
    timeouts: int = 0
    drops: int = 0
    skipped: int = 0
    redirects: int = 0
    breaker_trips: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __add__(self, other: RemoteMetrics) -> RemoteMetrics:
        """Counter by counter: two stores' (or shards') counters together."""
        return RemoteMetrics(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )


_REJECTION_COUNTER = {
    Rejection.CORRUPT: "rejected_corrupt",
    Rejection.LAYOUT: "rejected_layout",
    Rejection.KEYSPACE: "rejected_keyspace",
    Rejection.TOKENS: "rejected_tokens",
    Rejection.MAC: "rejected_mac",
}
logger = logging.getLogger(__name__)


class RemotePageStore:
    """Pages of one layout (one device shard) under one namespace on one Redis server or
    one Redis Cluster."""

    def __init__(
        self,
        url: str | Sequence[str],
        namespace: str,
        layout: RemoteLayout | StateLayout,
        *,
        mac_key: bytes | str | None = None,
        timeout_s: float = 0.25,
        max_queued_pages: int = 256,
        max_batch_pages: int = 32,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
    ) -> None:
        """`url`: `redis://host:port/db` (or `rediss://`, `unix://`), or a tuple of the
        `redis://host:port` URLs of a Redis Cluster's seed nodes; nothing is sent until
        the first call. `mac_key`: seal and check every value with this secret,
        shared by the servers (`codec.PageCodec`). `timeout_s` bounds each connect and
        each reply."""
        self.codec = PageCodec(layout, namespace, mac_key)
        for name, value in (
            ("max_queued_pages", max_queued_pages),
            ("max_batch_pages", max_batch_pages),
        ):
            if value.__class__ is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if timeout_s.__class__ not in (int, float) or not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(
                f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                f"got {timeout_s!r}"
            )
        self.layout = layout
        self.namespace = namespace
        self.metrics = RemoteMetrics()
        self.nodes = RedisNodes(
            url, timeout_s=timeout_s, failure_threshold=failure_threshold, cooldown_s=cooldown_s
        )
        self._metrics_lock = threading.Lock()
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, bytearray, int]] = deque()  # key, value, hash
        self._max_queued = max_queued_pages
        self._max_batch = max_batch_pages
        self._in_flight = 0
        self._closed = False
        self._writer = threading.Thread(
            target=self._write_loop, name="mokv-remote-writer", daemon=True
        )
        self._writer.start()

    @property
    def breaker(self) -> CircuitBreaker:
        """The breaker of a store on one server (on a cluster, each node has its own:
        `nodes`)."""
        if self.nodes.cluster:
            raise AttributeError("a cluster's store has one breaker per node: see `nodes`")
        return self.nodes.nodes[0].breaker

    @property
    def max_queued_pages(self) -> int:
        """Most pages queued for the writer; `put` drops (and counts) the next."""
        return self._max_queued

    def key(self, page_hash: int) -> str:
        """The Redis key of a page of this store's namespace and layout."""
        return self.codec.key(page_hash)

    # --- writes ---------------------------------------------------------------------

    def put(self, page_hash: int, token_bytes: bytes, page) -> bool:
        """Queues a copy of `page` (any buffer of `layout.page_shape`'s bytes, or a
        scaled page's values and scales as a tuple, `PageCodec.new_value`) for the
        writer; returns False, counted in `metrics.drops`, if the queue is full.

        The caller pays one copy (into the value); the header, the checksum, the MAC tag
        and the send happen on the writer thread."""
        value = self.codec.new_value(page_hash, token_bytes, page)
        with self._cond:
            if self._closed or len(self._queue) >= self._max_queued:
                self._count(drops=1)
                return False
            self._queue.append((self.key(page_hash), value, page_hash))
            self._cond.notify()
        return True

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Waits until every queued page was sent (or dropped); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._in_flight, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what is queued (for at most `timeout_s`), stops the writer, disconnects."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join(timeout_s)
        self.nodes.close()

    def __enter__(self) -> RemotePageStore:  # noqa: PYI034 (typing.Self is 3.11+)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed and not self._queue:
                    return
                batch = [
                    self._queue.popleft() for _ in range(min(self._max_batch, len(self._queue)))
                ]
                self._in_flight = len(batch)
            try:
                self._send(batch)
            except Exception:  # a bug, not the server: keep the thread, say so
                logger.exception("mokv remote writer: a batch of %d pages failed", len(batch))
                self._count(errors=1)
            finally:
                with self._cond:
                    self._in_flight = 0
                    self._cond.notify_all()

    def _send(self, batch: list[tuple[str, bytearray, int]]) -> None:
        for _, value, page_hash in batch:
            self.codec.seal(value, page_hash)
        commands = [("SET", key, memoryview(value), "NX") for key, value, _ in batch]
        out = self._run(commands, count_pages=True)
        written = [bool(r) for r, ok in zip(out.replies, out.answered) if ok]
        self._count(
            pages_written=sum(written),
            pages_present=len(written) - sum(written),
            bytes_written=sum(
                len(v) for r, ok, (_, v, _) in zip(out.replies, out.answered, batch) if ok and r
            ),
        )

    # --- reads ----------------------------------------------------------------------

    def probe(self, chain: Iterable[tuple[int, bytes]], max_pages: int | None = None) -> int:
        """How many leading pages of `chain` (at most `max_pages`) the server holds: one
        pipelined EXISTS per page, one round trip per server. Not validated (`lookup`
        may return fewer) and not counted as hits: a query for planning or routing."""
        return self.holds([page_hash for page_hash, _ in islice(chain, max_pages)])

    def holds(self, page_hashes: Sequence[int]) -> int:
        """`probe` by the pages' hashes alone (what a router has): 0 on any failure,
        after at most one timeout per server (`mokv.events.PrefixRouterIndex(shared=)`)."""
        found = 0
        for held in self.present(page_hashes):
            if not held:
                break
            found += 1
        return found

    def present(self, page_hashes: Sequence[int]) -> list[bool]:
        """Whether the server holds each of these pages (one pipelined EXISTS each, one
        round trip per server; not validated): False for each page of a failed server.
        A recurrent state's checkpoints stand at some boundaries of a chain, not in a
        run, so their lookup asks for each (`groups/state_shared.py`)."""
        if not page_hashes:
            return []
        out = self._run([("EXISTS", self.key(page_hash)) for page_hash in page_hashes])
        return [bool(ok and reply) for reply, ok in zip(out.replies, out.answered)]

    def get(self, page_hash: int, token_bytes: bytes) -> memoryview | None:
        """The validated bytes of one page (one GET, counted as a lookup of one page),
        None if the server lacks it, refuses it or fails: the page a caller chose after
        a `present` probe."""
        self._count(lookups=1)
        page = self._fetch([(page_hash, token_bytes)])
        self._count(hits=len(page), misses=1 - len(page))
        return page[0] if page else None

    def lookup(
        self, chain: Iterable[tuple[int, bytes]], max_pages: int | None = None
    ) -> list[memoryview]:
        """The page bytes of the leading pages of `chain` (at most `max_pages`) that the
        server holds and that pass every check, in chain order; [] on any failure.

        Each page is a read-only view of `layout.page_nbytes` bytes in
        `layout.page_shape` order, ready to copy into a device page."""
        chain = list(islice(chain, max_pages))
        self._count(lookups=1)
        found = self.holds([page_hash for page_hash, _ in chain])
        pages = self._fetch(chain[:found]) if found else []
        self._count(hits=len(pages), misses=int(len(pages) < len(chain)))
        return pages

    def _fetch(self, pages: Sequence[tuple[int, bytes]]) -> list[memoryview]:
        """The validated bytes of the leading `pages` (one pipelined GET each), up to the
        first one absent, refused or on a failed server."""
        out = self._run([("GET", self.key(h)) for h, _ in pages])
        found: list[memoryview] = []
        for value, ok, (page_hash, tokens) in zip(out.replies, out.answered, pages):
            if not ok or value is None:  # a failed node, or evicted since the probe
                break
            assert isinstance(value, bytes)
            self._count(bytes_read=len(value))
            page = self.codec.decode(value, page_hash, tokens)
            if isinstance(page, Rejection):
                self._count(**{_REJECTION_COUNTER[page]: 1})
                break
            found.append(page)
        return found

    # --- plumbing -------------------------------------------------------------------

    def _run(self, commands: list[tuple], count_pages: bool = False) -> NodeReplies:
        """`commands` on the servers (`RedisNodes.run`), their failures counted; what a
        breaker skipped counts in round trips (reads) or in pages (`count_pages`: writes)."""
        out = self.nodes.run(commands)
        skipped = out.skipped_commands if count_pages else out.skipped
        self._count(
            errors=out.errors, timeouts=out.timeouts, skipped=skipped, redirects=out.redirects
        )
        with self._metrics_lock:
            self.metrics.breaker_trips = self.nodes.breaker_trips
        return out

    def _count(self, **deltas: int) -> None:
        with self._metrics_lock:
            m = self.metrics
            for name, delta in deltas.items():
                setattr(m, name, getattr(m, name) + delta)
