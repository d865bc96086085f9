"""Consumers that mokv did not write, fed by real managers over TCP.

Each test here carries the `consumers` marker and imports its consumer with
`pytest.importorskip`, so that without the package it is skipped with the reason (and how
to install it: `make test-consumers`). `make test` never installs them.
"""

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import mokv
import numpy as np
import pytest
from max.driver import CPU
from mokv.events import EventSubscriber, KVEventsConfig, PrefixRouterIndex

from tests.child_env import child_env
from tests.managers.conftest import NUM_LAYERS, small_params

PAGE_SIZE = 4


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Server:
    """One mokv server: a paged manager (one replica on the CPU device, a host tier of 16
    pages) publishing on a TCP PUB socket with a replay socket."""

    def __init__(self, session, num_pages: int, salt_format: str = "vllm"):
        pub, replay = free_ports(2)
        self.endpoint, self.replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
        page_bytes = small_params().bytes_per_page(NUM_LAYERS)
        params = small_params(
            kv_events=KVEventsConfig(f"tcp://*:{pub}", replay_endpoint=f"tcp://*:{replay}",
                                     salt_format=salt_format),
            tiers=(mokv.HostTierConfig(swap_space_gb=16 * page_bytes / 2**30),),
        )
        self.m = mokv.PagedKVCacheManager(
            params, max_batch_size=4, max_seq_len=32, num_layers=NUM_LAYERS, devices=[CPU()],
            session=session, available_cache_memory=num_pages * page_bytes,
            page_size=PAGE_SIZE, enable_runtime_checks=True,
        )

    def start(self, tokens, salt=None) -> mokv.TextContext:
        """A request that prefills `tokens` and decodes one token: its full pages are
        committed; it keeps its pages until `release`."""
        ctx = mokv.TextContext(np.asarray(tokens), cache_salt=salt)
        self.m.external_claim(ctx.request_id)
        self.m.fetch([ctx])
        ctx.update(1)
        self.m.step([ctx])
        return ctx

    def serve(self, tokens, salt=None) -> None:
        self.m.release(self.start(tokens, salt).request_id)

    @property
    def last_seq(self) -> int:
        return self.m.kv_event_publishers[0].last_seq


def follow(servers: dict[str, Server]) -> tuple[PrefixRouterIndex, EventSubscriber]:
    """mokv's own router index, subscribed to every server."""
    index = PrefixRouterIndex(page_size=PAGE_SIZE)
    subscriber = EventSubscriber(index)
    for name, server in servers.items():
        subscriber.add_source(name, server.endpoint, replay_endpoint=server.replay)
    return index, subscriber


def catch_up(subscriber: EventSubscriber, servers: dict[str, Server], timeout=10.0) -> None:
    subscriber.sync()
    deadline = time.monotonic() + timeout
    while any(subscriber.last_seq((name, 0)) != s.last_seq for name, s in servers.items()):
        assert time.monotonic() < deadline, "mokv's subscriber did not catch up"
        subscriber.poll(timeout_ms=10)


class DynamoIndexer:
    """NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`, from the
    ai-dynamo-runtime wheel) in its own process, on a loopback HTTP port."""

    def __init__(self, log_path):
        (self.port,) = free_ports(1)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=self.log, stderr=subprocess.STDOUT, env=child_env(),
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"dynamo.indexer did not start (see {log_path})") from None
                time.sleep(0.1)

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as reply:
            return json.loads(reply.read() or b"null")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture
def dynamo_indexer(tmp_path):
    pytest.importorskip(
        "dynamo.llm", reason="NVIDIA Dynamo's indexer is not installed (make test-consumers)"
    )
    indexer = DynamoIndexer(tmp_path / "dynamo-indexer.log")
    yield indexer
    indexer.close()
