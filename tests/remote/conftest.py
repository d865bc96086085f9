"""A real redis-server per test module (or per test, for the ones that kill it).

Started on 127.0.0.1 with a free port, no persistence, a small maxmemory and
allkeys-lru, as the shared tier expects in production. Without the binary the tests skip
with how to install it, except under CI (CI=true), where they fail: CI must run them.
"""

import itertools
import os
import shutil
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
import redis
from max.dtype import DType
from mokv.cache.hashing import iter_page_hashes, page_hash_fn, salted_root
from mokv.remote import PageCodec, RemoteLayout, RemotePageStore
from xxhash import xxh3_64

REDIS_SERVER = shutil.which("redis-server")  # None: the tests skip (or fail under CI)
INSTALL_HINT = (
    "redis-server or redis-cli not found: install them (Debian/Ubuntu: `sudo apt-get install redis-server`, "
    "macOS: `brew install redis`) to run the shared-tier tests"
)
SMALL = RemoteLayout(DType.float32, page_size=4, num_layers=2, n_kv_heads_per_device=2,
                     head_dim=8)  # 1 KiB pages
_namespaces = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; `kill`, `restart`, `pause` and `resume` it at will."""

    def __init__(self, workdir, maxmemory: str = "64mb", cluster_args: tuple = ()) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir, self.maxmemory, self.cluster_args = workdir, maxmemory, cluster_args
        self.proc: subprocess.Popen = None  # type: ignore[assignment]  # `start` sets it
        self.start()

    def start(self) -> None:
        with open(os.path.join(self.workdir, f"redis-{self.port}.log"), "ab") as log:
            self.proc = subprocess.Popen(
                [REDIS_SERVER or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--maxmemory", self.maxmemory,
                 "--maxmemory-policy", "allkeys-lru", "--dir", str(self.workdir),
                 *self.cluster_args],
                stdout=log, stderr=subprocess.STDOUT,
            )
        client = self.client()
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)
        client.close()

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel but nothing answers."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.kill()


def _require_redis(binary: str | None = REDIS_SERVER) -> None:
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail(INSTALL_HINT + " (CI=true: these tests must run; .ci/run installs it)")
        pytest.skip(INSTALL_HINT)


def _server(tmp_path_factory, maxmemory="64mb") -> RedisServer:
    _require_redis()
    return RedisServer(tmp_path_factory.mktemp("redis"), maxmemory)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A server shared by a module's tests (each test uses its own namespace)."""
    server = _server(tmp_path_factory)
    yield server
    server.stop()


@pytest.fixture
def own_redis_server(tmp_path_factory):
    """A server for one test, which may kill, restart or pause it."""
    server = _server(tmp_path_factory)
    yield server
    server.stop()


@pytest.fixture
def small_redis_server(tmp_path_factory):
    """A server with 2 MB of maxmemory: it evicts (allkeys-lru) almost at once."""
    server = _server(tmp_path_factory, maxmemory="2mb")
    yield server
    server.stop()


@pytest.fixture
def make_store():
    """make_store(server, layout=SMALL, namespace=None, url=None, **options): a store in
    a fresh namespace (or `namespace`) on `server` (or at `url`), closed at the end of
    the test."""
    stores = []

    def make(server, layout=SMALL, namespace=None, url=None, **options):
        namespace = namespace or f"test-{os.getpid()}-{next(_namespaces)}"
        stores.append(RemotePageStore(url or server.url, namespace, layout, **options))
        return stores[-1]

    yield make
    for store in stores:
        store.close(timeout_s=1)


def chain(num_pages: int, page_size: int = 4, seed: int = 0, salt: str | None = None):
    """(page hash, token bytes) of `num_pages` pages of random tokens: mokv's own xxh3 chain."""
    tokens = np.random.default_rng(seed).integers(0, 32000, num_pages * page_size)
    return list(iter_page_hashes(tokens, page_size, salted_root("xxh3", 0, salt),
                                 page_hash_fn("xxh3")))


def pages(num_pages: int, layout: RemoteLayout = SMALL, seed: int = 0) -> list[np.ndarray]:
    """Random float32 pages of `layout`'s shape."""
    rng = np.random.default_rng(seed + 1000)
    return [rng.standard_normal(layout.page_shape, dtype=np.float32) for _ in range(num_pages)]


def put_all(store, links, datas, timeout_s=10) -> None:
    for (page_hash, tokens), data in zip(links, datas):
        assert store.put(page_hash, tokens, data)
    assert store.flush(timeout_s)


def forged_value(codec: PageCodec, page_hash: int, token_bytes: bytes, page) -> bytes:
    """What a writer with access to the server but without the MAC key can make for
    `codec`'s key space: every header field, the key space digest (from the key names
    it sees) and the checksum right, the tag guessed."""
    layout = codec.layout
    value = bytearray(PageCodec(layout, "forger").encode(page_hash, token_bytes, page))
    value[28:36] = codec.encode(page_hash, token_bytes, bytes(layout.page_nbytes))[28:36]
    if codec.sealed:
        value += bytes(32)  # a tag of the right size
    check = xxh3_64(bytes(value[:56]))
    check.update(bytes(value[64:]))
    value[56:64] = check.intdigest().to_bytes(8, "little")
    return bytes(value)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A Redis Cluster of 3 masters with one replica each, shared by the session's tests
    (each uses its own namespace; one that kills a node leaves the cluster ok)."""
    from ._cluster import RedisClusterProcesses

    _require_redis()
    _require_redis(shutil.which("redis-cli"))  # Debian's redis-tools, which redis-server needs
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()
