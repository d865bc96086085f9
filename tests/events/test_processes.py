"""Across processes: two managers publish over TCP while this process subscribes; after a
long random run each source's rebuilt index equals that manager's own hash index. And
page hashes (salted too) are the same in another process with another hash seed."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from mokv.events import EventSubscriber, PrefixRouterIndex

from .conftest import free_port

HERE = Path(__file__).resolve().parent


def child_env(**extra) -> dict:
    # MAX's native code leaves PYTHONPATH=":" etc. in the C environment; pass Python's view.
    drop = ("PYTHONEXECUTABLE", "PYTHONPATH", "MOJO_PYTHON_LIBRARY")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


def test_two_manager_processes_rebuild_exactly(tmp_path):
    idx = PrefixRouterIndex(page_size=4)
    sub = EventSubscriber(idx)
    procs, outputs = [], {}
    for name, seed in (("m0", 1), ("m1", 2)):
        port, replay = free_port(), free_port()
        for r in range(2):
            sub.add_source(name, f"tcp://127.0.0.1:{port + r}", f"tcp://127.0.0.1:{replay + r}")
        p = subprocess.Popen(
            [sys.executable, str(HERE / "_manager_process.py"), str(port), str(replay),
             str(seed), "3000"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
        threading.Thread(target=lambda p=p, n=name: outputs.__setitem__(n, p.stdout.readline()),
                         daemon=True).start()
        procs.append((name, p))
    try:
        time.sleep(1.0)
        for _, p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        deadline = time.monotonic() + 120
        while len(outputs) < 2 and time.monotonic() < deadline:
            sub.poll(20)
        assert len(outputs) == 2, "a manager process did not finish"
        for name, _ in procs:
            own = json.loads(outputs[name])
            for r in range(2):
                while sub.last_seq((name, r)) != own["last_seq"][r] and time.monotonic() < deadline:
                    sub.poll(20)
                    if sub.last_seq((name, r)) is None:
                        sub.sync()
                assert sub.last_seq((name, r)) == own["last_seq"][r]
                assert own["last_seq"][r] > 100  # a long run
                assert idx.hashes((name, r)) == set(own["hashes"][r])
        assert sub.num_restarts == 0 and sub.num_lost_gaps == 0
    finally:
        for _, p in procs:
            try:
                p.stdin.write("stop\n")
                p.stdin.flush()
            except BrokenPipeError:
                pass
            p.wait(30)
        sub.close()


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
