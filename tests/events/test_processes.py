"""Across processes: two managers publish over TCP while a third process (a router) runs
mokv's subscriber and index; after a long random run each source's rebuilt index equals
that manager's own hash index. And page hashes (salted too) are the same in another
process with another hash seed."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from mokv.events import PrefixRouterIndex

from ..child_env import child_env
from .conftest import free_port_runs

HERE = Path(__file__).resolve().parent


def _start(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / script), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=child_env())


def _send(p: subprocess.Popen, line: str) -> None:
    assert p.stdin is not None  # `_start` opens a pipe
    p.stdin.write(line + "\n")
    p.stdin.flush()


def _read_lines(procs: dict, timeout: float) -> dict:
    """One stdout line of each process in `procs` (name -> Popen), read concurrently."""
    out: dict = {}
    threads = [threading.Thread(target=lambda n=n, p=p: out.__setitem__(n, p.stdout.readline()),
                                daemon=True) for n, p in procs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert set(out) == set(procs) and all(out.values()), f"no output from {set(procs) - set(out)}"
    return out


def test_two_manager_processes_rebuild_exactly():
    # Per manager 4 ports: its 2 replicas' PUB sockets, then their 2 replay sockets.
    ports = {name: (base, base + 2) for name, base in zip(("m0", "m1"), free_port_runs(2, 4))}
    router = _start("_subscriber_process.py")
    managers = {name: _start("_manager_process.py", str(port), str(replay), str(seed), "3000")
                for seed, (name, (port, replay)) in enumerate(ports.items(), start=1)}
    try:
        sources = [[name, f"tcp://127.0.0.1:{port + r}", f"tcp://127.0.0.1:{replay + r}"]
                   for name, (port, replay) in ports.items() for r in range(2)]
        _send(router, json.dumps({"page_size": 4, "sources": sources}))
        assert _read_lines({"router": router}, 60)["router"].strip() == "ready"
        time.sleep(1.0)  # let the SUB sockets finish connecting before the first batches
        for p in managers.values():
            _send(p, "go")
        own = {name: json.loads(line) for name, line in _read_lines(managers, 300).items()}
        until = {f"{name}/{r}": own[name]["last_seq"][r] for name in managers for r in range(2)}
        _send(router, json.dumps({"until": until}))
        rebuilt = json.loads(_read_lines({"router": router}, 90)["router"])
        for name in managers:
            for r in range(2):
                assert own[name]["last_seq"][r] > 100  # a long run
                assert rebuilt["last_seq"][f"{name}/{r}"] == own[name]["last_seq"][r]
                assert rebuilt["hashes"][f"{name}/{r}"] == own[name]["hashes"][r]
        assert rebuilt["num_restarts"] == 0 and rebuilt["num_lost_gaps"] == 0
    finally:
        for p in managers.values():
            try:
                _send(p, "stop")
            except BrokenPipeError:
                pass
        for p in (*managers.values(), router):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def test_hashes_are_the_same_in_another_process():
    code = (
        "import numpy as np, json; from mokv.events import PrefixRouterIndex\n"
        "out = {}\n"
        "for algo in ('xxh3', 'sha256'):\n"
        "    i = PrefixRouterIndex(4, algo, 7)\n"
        "    out[algo] = [i.page_hashes(np.arange(12), s) for s in (None, 'tenant-a')]\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_env(PYTHONHASHSEED="12345"), check=True)
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for algo in ("xxh3", "sha256"):
        i = PrefixRouterIndex(4, algo, 7)
        ours = [i.page_hashes(np.arange(12), s) for s in (None, "tenant-a")]
        assert theirs[algo] == ours
        assert not set(ours[0]) & set(ours[1])
