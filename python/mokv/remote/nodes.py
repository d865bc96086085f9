"""RedisNodes: the Redis servers behind a page store, each with its circuit breaker.

A store talks to one Redis server, or to the masters of a Redis Cluster. Either way it
hands `run` a batch of single-key commands and gets one reply per command back, never an
exception for a server problem:

    one server   every command goes to it, as one pipeline (one round trip)
    a cluster    each command goes to the master that holds its key's hash slot (CRC16
                 of the whole key: mokv's keys carry no `{hash tag}`, so pages spread
                 over every master); one pipeline per master, sent one after the other

A page is one key, whose value carries everything needed to verify it (header, tokens,
keys digest, page bytes, tag: `codec.py`), so a page is written and read whole on the
one master that holds its slot, and no check ever needs a second key on another node.

Failures, per node: each node has its own `CircuitBreaker`, so a dead master costs the
misses of its own slots, while the other masters answer. A node that fails (a refused
or dropped connection, a timeout), whose breaker is open, or that answers a redirection
(MOVED / ASK: its slots moved, e.g. after a failover; CLUSTERDOWN / TRYAGAIN) leaves its
commands unanswered, and marks the slot map stale (a failed master's replica may have
taken over: its slots are served again within a refresh, not a breaker's cooldown):
the next `run` asks the cluster for it again (`CLUSTER SLOTS`, from the seeds first,
then the nodes it knew), at most once per `REFRESH_INTERVAL_S`.

Why not redis-py's own `RedisCluster`: its pipeline raises for the whole batch when one
node fails, and retries failed commands one at a time through its own retry policy with
backoff, reinitializing the slot map as it goes. A cache lookup has to be bounded by the
store's timeout and turn a node's failure into that node's misses; this class uses the
plain per-node client (`redis.Redis`, whose pipeline it drives) and redis-py's
`key_slot`, and owns the routing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import redis
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.retry import Retry

from .breaker import CircuitBreaker

NETWORK_ERRORS = (redis.RedisError, OSError)
"""What a round trip may raise for a server problem (a miss, never an error)."""
REDIRECTIONS = (
    redis.exceptions.AskError,  # MovedError too
    redis.exceptions.ClusterDownError,  # MasterDownError too
    redis.exceptions.TryAgainError,
)
"""Error replies of a cluster whose slots moved or are not served now (MOVED, ASK,
CLUSTERDOWN, MASTERDOWN, TRYAGAIN), as redis-py's parser types them: it strips the
reply's first word from the message, so the type is all that tells them apart."""
REFRESH_INTERVAL_S = 0.5
"""Least time between two slot-map refreshes: a failover takes the cluster about twice
its `cluster-node-timeout`, and each refresh costs a round trip."""
logger = logging.getLogger(__name__)


class NodeReplies(NamedTuple):
    """What `RedisNodes.run` got: `replies[i]` answers command `i` where `answered[i]`
    (else None), and the round trips' counters."""

    replies: list[object]
    answered: list[bool]
    errors: int = 0
    """Round trips that failed (a refused or dropped connection, an error reply)."""
    timeouts: int = 0
    """Round trips that timed out (counted here only)."""
    skipped: int = 0
    """Round trips not attempted: the node's breaker was open, or no node holds the slot."""
    skipped_commands: int = 0
    """Commands of those round trips."""
    redirects: int = 0
    """Commands answered with a redirection (MOVED, ASK, CLUSTERDOWN, TRYAGAIN)."""


class RedisNode:
    """One server: its client (a connection pool) and its breaker."""

    def __init__(self, address: str, client: redis.Redis, breaker: CircuitBreaker) -> None:
        self.address = address
        self.client = client
        self.breaker = breaker

    def pipeline(self, commands: Sequence[tuple]) -> list[object]:
        """The replies of `commands` in one round trip (error replies as exceptions in
        the list); raises for a network failure."""
        pipe = self.client.pipeline(transaction=False)
        for args in commands:
            pipe.execute_command(*args)
        return pipe.execute(raise_on_error=False)


class RedisNodes:
    """The servers of one store: `servers` is a Redis URL (one server), or a tuple of the
    URLs of a Redis Cluster's seed nodes (any of its nodes; the others are found). Nothing
    is sent before the first `run`.

    Args:
        timeout_s: bound on each connect and each reply, per node.
        failure_threshold / cooldown_s: each node's `CircuitBreaker`.
    """

    def __init__(
        self,
        servers: str | Sequence[str],
        *,
        timeout_s: float,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
    ) -> None:
        self.cluster = not isinstance(servers, str)
        seeds = [servers] if isinstance(servers, str) else list(servers)
        if not seeds or not all(isinstance(url, str) for url in seeds):
            raise ValueError(f"servers must be a Redis URL or a tuple of them, got {servers!r}")
        CircuitBreaker(failure_threshold, cooldown_s)  # checks both before anything is built
        self._failure_threshold = failure_threshold
        self._cooldown_s = cooldown_s
        # One retry, without backoff, for a connection the server dropped (a restart);
        # timeouts are never retried, so a slow server costs at most timeout_s per try.
        self._client_options = dict(
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            health_check_interval=0,
        )
        self._lock = threading.Lock()
        self._nodes: dict[str, RedisNode] = {}
        self._pool_template: redis.ConnectionPool | None = None
        self._seeds = [self._seed(url) for url in seeds]
        self._slots: list[RedisNode | None] | None = None  # slot -> master (a cluster)
        self._stale = True
        self._next_refresh = 0.0
        self._refresh_lock = threading.Lock()
        self._warned: set[str] = set()  # nodes that said they are not cluster nodes

    def _seed(self, url: str) -> RedisNode:
        pool = redis.ConnectionPool.from_url(url, **self._client_options)
        kwargs = pool.connection_kwargs
        if self.cluster and ("path" in kwargs or kwargs.get("db", 0) != 0):
            raise ValueError(
                "a Redis Cluster's nodes are host:port URLs of database 0 (a cluster has "
                f"no other database and no unix socket), got {url.split('@')[-1]!r}"
            )
        if self._pool_template is None:
            self._pool_template = pool  # TLS and credentials of every node found later
        address = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
        return self._add(address, pool)

    def _add(self, address: str, pool: redis.ConnectionPool) -> RedisNode:
        """The node at `address`, made with `pool` unless known (no connection is made)."""
        with self._lock:
            node = self._nodes.get(address)
            if node is None:
                breaker = CircuitBreaker(self._failure_threshold, self._cooldown_s)
                client = redis.Redis(connection_pool=pool)
                node = self._nodes[address] = RedisNode(address, client, breaker)
            return node

    def _node_at(self, host: str, port: int) -> RedisNode:
        """The node at host:port, connecting as the first seed does (TLS, credentials)."""
        with self._lock:
            node = self._nodes.get(f"{host}:{port}")
        if node is not None:
            return node
        template = self._pool_template
        assert template is not None  # set by the first seed
        kwargs = dict(template.connection_kwargs, host=host, port=port)
        pool = redis.ConnectionPool(connection_class=template.connection_class, **kwargs)
        return self._add(f"{host}:{port}", pool)

    @property
    def nodes(self) -> list[RedisNode]:
        """Every node known so far (seeds first)."""
        with self._lock:
            return list(self._nodes.values())

    def node(self, address: str) -> RedisNode:
        """The node at `address` ("host:port"); KeyError if none is known."""
        with self._lock:
            return self._nodes[address]

    @property
    def breaker_trips(self) -> int:
        """Times any node's breaker opened."""
        return sum(node.breaker.trips for node in self.nodes)

    def set_cooldown(self, cooldown_s: float) -> None:
        """Every node's breaker (and those of nodes found later) waits `cooldown_s`."""
        CircuitBreaker(self._failure_threshold, cooldown_s)  # checks it
        self._cooldown_s = cooldown_s
        for node in self.nodes:
            node.breaker.cooldown_s = cooldown_s

    def masters(self) -> list[RedisNode]:
        """The nodes that hold slots now (one server: the server); refreshes the map
        when it is stale."""
        if not self.cluster:
            return self._seeds
        table = self._table()
        seen: dict[str, RedisNode] = {}
        for node in table or ():
            if node is not None:
                seen.setdefault(node.address, node)
        return list(seen.values())

    def node_of(self, key: str | bytes) -> RedisNode | None:
        """The node that holds `key` now, or None (no slot map)."""
        if not self.cluster:
            return self._seeds[0]
        table = self._table()
        return None if table is None else table[_slot(key)]

    # --- one batch ------------------------------------------------------------------

    def run(self, commands: Sequence[tuple]) -> NodeReplies:
        """Sends each command (`(name, key, *args)`) to the node holding its key, one
        pipeline per node; a node whose breaker is open, that fails or that redirects
        leaves its commands unanswered (counted)."""
        replies: list[object] = [None] * len(commands)
        answered = [False] * len(commands)
        counts = dict(errors=0, timeouts=0, skipped=0, skipped_commands=0, redirects=0)
        for node, indices in self._route(commands, counts):
            if node is None or not node.breaker.allow():
                counts["skipped"] += 1
                counts["skipped_commands"] += len(indices)
                # Its replica may have taken over since: ask for the map again rather
                # than wait for the breaker's trial (cooldown_s) to find out.
                self._stale = True
                continue
            try:
                got = node.pipeline([commands[i] for i in indices])
            except NETWORK_ERRORS as e:
                node.breaker.failure()
                timeout = isinstance(e, (redis.TimeoutError, TimeoutError))
                counts["timeouts" if timeout else "errors"] += 1
                self._stale = True
                continue
            except BaseException:  # not the server's fault, but never leave a trial open
                node.breaker.failure()
                raise
            node.breaker.success()
            for i, reply in zip(indices, got):
                if isinstance(reply, redis.ResponseError):
                    if isinstance(reply, REDIRECTIONS):
                        counts["redirects"] += 1
                        self._stale = True
                    else:
                        counts["errors"] += 1
                    continue
                replies[i] = reply
                answered[i] = True
        return NodeReplies(replies, answered, **counts)

    def _route(
        self, commands: Sequence[tuple], counts: dict[str, int]
    ) -> list[tuple[RedisNode | None, list[int]]]:
        """The commands' indices grouped by the node holding their keys (None: no node
        known for the slot), in order of first appearance."""
        if not commands:
            return []
        if not self.cluster:
            return [(self._seeds[0], list(range(len(commands))))]
        table = self._table()
        groups: dict[str, tuple[RedisNode | None, list[int]]] = {}
        for i, args in enumerate(commands):
            node = None if table is None else table[_slot(args[1])]
            name = "" if node is None else node.address
            groups.setdefault(name, (node, []))[1].append(i)
        return list(groups.values())

    # --- the slot map ---------------------------------------------------------------

    def _table(self) -> list[RedisNode | None] | None:
        """The slot map, asked for again when stale (at most once per interval; a thread
        that finds another refreshing uses the old map)."""
        if self._stale and time.monotonic() >= self._next_refresh:
            if self._refresh_lock.acquire(blocking=False):
                try:
                    self._refresh()
                finally:
                    self._refresh_lock.release()
        return self._slots

    def _refresh(self) -> None:
        self._next_refresh = time.monotonic() + REFRESH_INTERVAL_S
        known = [node for node in self.nodes if node not in self._seeds]
        for node in [*self._seeds, *known]:
            if not node.breaker.allow():
                continue
            try:
                reply = node.client.execute_command("CLUSTER", "SLOTS")
            except redis.ResponseError as e:  # not a cluster node: say so once, ask others
                node.breaker.success()
                if node.address not in self._warned:
                    self._warned.add(node.address)
                    logger.warning("mokv remote: %s answered CLUSTER SLOTS: %s", node.address, e)
                continue
            except NETWORK_ERRORS:
                node.breaker.failure()
                continue
            except BaseException:
                node.breaker.failure()
                raise
            node.breaker.success()
            host = node.client.connection_pool.connection_kwargs.get("host", "")
            self._slots = self._slot_table(reply, host)
            self._stale = False
            return

    def _slot_table(self, reply, asked_host: str) -> list[RedisNode | None]:
        """slot -> master from a `CLUSTER SLOTS` reply (`[start, end, [host, port, id,
        ...], replicas...]` per range; an empty host is the node that answered)."""
        table: list[RedisNode | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        for start, end, master, *_ in reply:
            host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
            node = self._node_at(host or asked_host, int(master[1]))
            table[int(start) : int(end) + 1] = [node] * (int(end) - int(start) + 1)
        return table

    def close(self) -> None:
        """Disconnects every node."""
        for node in self.nodes:
            node.client.connection_pool.disconnect()


def _slot(key: str | bytes) -> int:
    return key_slot(key.encode() if isinstance(key, str) else key)
