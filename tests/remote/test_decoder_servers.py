"""Two server processes, each with its own manager and decoder, share one redis-server:
B reuses the prefixes A computed, and every greedy output equals the uncached
recompute, also while the server is dead (misses) and after it is back (hits again).
A server restarted on a Redis Cluster serves its earlier prefixes from it at once."""

import json
import os
import subprocess
import sys
import time

import mokv_graphs as mg
import numpy as np

from ..model.conftest import CONFIG, PAGE_SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_NEW = 5


class Server:
    """A `_decoder_server` process."""

    def __init__(self, url: str | tuple[str, ...], namespace: str) -> None:
        url = url if isinstance(url, str) else ",".join(url)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.remote._decoder_server", url, namespace],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def wait_ready(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None  # pipes
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", f"server did not start (rc {self.proc.poll()})"

    def serve(self, prompts: list[np.ndarray]) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None  # pipes
        self.proc.stdin.write(
            json.dumps({"prompts": [p.tolist() for p in prompts], "max_new": MAX_NEW}) + "\n"
        )
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"server died (rc {self.proc.poll()})"
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None  # a pipe
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def assert_greedy(reply: dict, prompts: list[np.ndarray], weights) -> None:
    for tokens, prompt in zip(reply["tokens"], prompts):
        assert tokens[: len(prompt)] == prompt.tolist()
        assert len(tokens) == len(prompt) + MAX_NEW
        assert mg.first_mismatch(CONFIG, weights, np.array(tokens), len(prompt)) is None


def prompts_on(systems, rng) -> list[np.ndarray]:
    return [np.r_[s, rng.integers(0, CONFIG.vocab_size, 3 + i)] for i, s in enumerate(systems)]


def remote_tokens(reply: dict) -> int:
    return reply["remote_cache_tokens"]


def test_b_reuses_a_prefixes_and_both_survive_a_server_restart(own_redis_server):
    weights = mg.init_weights(CONFIG, seed=1)
    rng = np.random.default_rng(13)
    systems = [rng.integers(0, CONFIG.vocab_size, 4 * PAGE_SIZE + 3) for _ in range(3)]
    namespace = f"decoder-{os.getpid()}"
    a, b = Server(own_redis_server.url, namespace), Server(own_redis_server.url, namespace)
    try:
        a.wait_ready()
        b.wait_ready()
        # A computes three system prompts; B, which never saw them, loads their pages.
        prompts = prompts_on(systems, rng)
        reply = a.serve(prompts)
        assert_greedy(reply, prompts, weights)
        assert remote_tokens(reply) == 0 and reply["remote"]["pages_written"] >= 12
        prompts = prompts_on(systems, rng)
        reply = b.serve(prompts)
        assert_greedy(reply, prompts, weights)
        assert remote_tokens(reply) == 3 * 4 * PAGE_SIZE  # every full system page
        # The server dies: both keep serving correct outputs, as misses.
        own_redis_server.kill()
        fresh = [rng.integers(0, CONFIG.vocab_size, 2 * PAGE_SIZE + 1) for _ in range(2)]
        for server in (a, b):
            before = remote_tokens(server.serve([]))
            prompts = prompts_on(fresh, rng)
            reply = server.serve(prompts)
            assert_greedy(reply, prompts, weights)
            remote = reply["remote"]
            assert remote_tokens(reply) == before
            assert remote["errors"] + remote["timeouts"] + remote["skipped"] > 0
        # Back on the same port (empty): after the breaker's cooldown (0.5 s in the
        # servers) A's first lookup is its trial, its pages reach Redis, and B hits them.
        own_redis_server.start()
        time.sleep(1.0)
        later = [rng.integers(0, CONFIG.vocab_size, 3 * PAGE_SIZE + 2) for _ in range(2)]
        prompts = prompts_on(later, rng)
        reply = a.serve(prompts)
        assert_greedy(reply, prompts, weights)
        before = remote_tokens(b.serve([]))
        prompts = prompts_on(later, rng)
        reply = b.serve(prompts)
        assert_greedy(reply, prompts, weights)
        assert remote_tokens(reply) - before == 2 * 3 * PAGE_SIZE
    finally:
        a.stop()
        b.stop()


def test_a_restarted_server_serves_its_earlier_prefixes_from_the_cluster(redis_cluster):
    """Warm restart: nothing survives in the process (device pages, their index, the
    host tier); the new one's first request finds the old one's pages in the cluster."""
    weights = mg.init_weights(CONFIG, seed=1)
    rng = np.random.default_rng(29)
    systems = [rng.integers(0, CONFIG.vocab_size, 4 * PAGE_SIZE + 3) for _ in range(3)]
    namespace = f"restart-{os.getpid()}"
    first = Server(redis_cluster.url, namespace)
    try:
        first.wait_ready()
        prompts = prompts_on(systems, rng)
        reply = first.serve(prompts)
        assert_greedy(reply, prompts, weights)
        assert remote_tokens(reply) == 0 and reply["remote"]["pages_written"] >= 12
    finally:
        first.stop()  # close() sends what is queued
    again = Server(redis_cluster.url, namespace)
    try:
        again.wait_ready()
        prompts = prompts_on(systems, rng)
        reply = again.serve(prompts)  # its first request
        assert_greedy(reply, prompts, weights)
        assert remote_tokens(reply) == 3 * 4 * PAGE_SIZE  # prefill saved: every full page
        assert reply["remote"]["errors"] == reply["remote"]["rejected_layout"] == 0
    finally:
        again.stop()
