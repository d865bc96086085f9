"""Two OS processes share one server: what A stores, B finds (page hashes are stable
across processes, whatever each interpreter's hash seed)."""

import json
import os
import subprocess
import sys

from .conftest import SMALL, chain

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(url, namespace, mode, seed, num_pages, hash_seed):
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed))
    out = subprocess.run(
        [sys.executable, "-m", "tests.remote._store_process", url, namespace, mode,
         str(seed), str(num_pages)],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pages_stored_by_one_process_are_found_by_another(redis_server, make_store):
    a = run(redis_server.url, "shared", "put", 3, 6, hash_seed=1)
    b = run(redis_server.url, "shared", "get", 3, 6, hash_seed=2)
    assert b["hashes"] == a["hashes"]
    assert b["found"] == a["found"] == 6 and b["digest"] == a["digest"]
    # This process (a third hash seed) finds them too, and nothing for other tokens.
    store = make_store(redis_server, SMALL, namespace="shared")
    links = chain(6, seed=3, salt="tenant-a")
    assert [h for h, _ in links] == a["hashes"]
    assert store.probe(links) == 6 and store.probe(chain(6, seed=4, salt="tenant-a")) == 0
