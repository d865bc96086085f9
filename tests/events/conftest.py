"""Managers that publish events, and raw ZMQ readers, all on loopback / inproc / ipc."""

import itertools
import os
import socket
import time

import mokv
import pytest
import zmq
from max.driver import CPU
from mokv.events import KVEventsConfig

from tests.managers.conftest import NUM_LAYERS, small_params

_names = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_runs(count: int, length: int) -> list[int]:
    """The first ports of `count` disjoint runs of `length` free consecutive ports: a
    publisher binds port + replica, and ports picked one by one are often consecutive
    (so a replay port could be another replica's port)."""
    held: list[socket.socket] = []
    bases: list[int] = []
    try:
        while len(bases) < count:
            first = socket.socket()
            first.bind(("127.0.0.1", 0))
            base, run = first.getsockname()[1], [first]
            try:
                for k in range(1, length):
                    run.append(socket.socket())
                    run[-1].bind(("127.0.0.1", base + k))
            except OSError:
                for s in run:
                    s.close()
                continue
            held += run
            bases.append(base)
        return bases
    finally:
        for s in held:
            s.close()


def inproc_name() -> str:
    return f"inproc://mokv-events-{os.getpid()}-{next(_names)}"


def make_publishing(session, config: KVEventsConfig, num_pages=4, dp=1, **overrides):
    """A paged manager publishing events; returns once its startup batch (seq 0) is out."""
    params = small_params(data_parallel_degree=dp, n_devices=dp, **overrides)
    m = mokv.PagedKVCacheManager(
        params, max_batch_size=4 * dp, max_seq_len=16, num_layers=NUM_LAYERS,
        devices=[CPU()] * dp, session=session,
        available_cache_memory=dp * num_pages * params.bytes_per_page(NUM_LAYERS),
        page_size=params.page_size, enable_runtime_checks=True, kv_events_config=config,
    )
    deadline = time.monotonic() + 5
    while any(p.num_published < 1 for p in m.kv_event_publishers) and time.monotonic() < deadline:
        time.sleep(0.005)
    return m


class Reader:
    """A SUB socket that collects raw [topic, seq, payload] messages."""

    def __init__(self, endpoint: str, bind: bool = False):
        self.sock: zmq.Socket = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        time.sleep(0.1)  # let the subscription reach the publisher

    def take(self, n: int, timeout: float = 5.0) -> list[list[bytes]]:
        out: list[list[bytes]] = []
        deadline = time.monotonic() + timeout
        while len(out) < n and self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            out.append(self.sock.recv_multipart())
        assert len(out) == n, f"got {len(out)} of {n} messages"
        return out

    def close(self):
        self.sock.close()


@pytest.fixture
def reader_factory():
    readers = []

    def make(endpoint, bind=False):
        readers.append(Reader(endpoint, bind))
        return readers[-1]

    yield make
    for r in readers:
        r.close()
