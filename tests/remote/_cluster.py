"""A real Redis Cluster of redis-server processes on 127.0.0.1 (the `redis_cluster`
fixture): masters with one replica each, made by `redis-cli --cluster create`, each node
on a port (and a cluster bus port) the OS found free. `kill` and `restart` a node at
will; a restarted node keeps its nodes.conf, so it rejoins (as a replica once its
replica took over)."""

import shutil
import subprocess
import time

import redis

from .conftest import RedisServer, free_port

REDIS_CLI = shutil.which("redis-cli") or "redis-cli"
NODE_TIMEOUT_MS = 1000
"""cluster-node-timeout: a dead master's replica takes over within about twice this."""


class RedisClusterProcesses:
    """`num_masters` masters and `replicas` replicas of each; `url` is the tuple of seed
    URLs a `RemoteTierConfig` (or a `RemotePageStore`) takes."""

    def __init__(self, workdir, num_masters: int = 3, replicas: int = 1) -> None:
        self.servers: list[RedisServer] = []
        try:
            for i in range(num_masters * (1 + replicas)):
                args = ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{i}.conf",
                        "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                        "--cluster-require-full-coverage", "no",  # as docs/tiers.md says
                        "--cluster-port", str(free_port()))
                self.servers.append(RedisServer(workdir, cluster_args=args))
            subprocess.run(
                [REDIS_CLI, "--cluster", "create",
                 *(f"127.0.0.1:{s.port}" for s in self.servers),
                 "--cluster-replicas", str(replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        self.url = tuple(s.url.removesuffix("/0") for s in self.servers[:2])

    def by_address(self, address: str) -> RedisServer:
        return next(s for s in self.servers if f"127.0.0.1:{s.port}" == address)

    def masters(self) -> set[str]:
        """The addresses of the masters holding slots, as a live node sees them."""
        for server in self.live():
            with server.client() as client:
                try:
                    ranges = client.execute_command("CLUSTER", "SLOTS")
                except redis.RedisError:
                    continue
            return {f"127.0.0.1:{int(r[2][1])}" for r in ranges}
        raise RuntimeError("no live cluster node")

    def live(self) -> list[RedisServer]:
        return [s for s in self.servers if s.proc.poll() is None]

    def wait_ok(self, timeout_s: float = 60) -> None:
        """Until every live node says cluster_state:ok and all see the same live masters."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._ok():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not become ok")
            time.sleep(0.1)

    def _ok(self) -> bool:
        live = {f"127.0.0.1:{s.port}" for s in self.live()}
        for server in self.live():
            with server.client() as client:
                if b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    return False
        return self.masters() <= live

    def replica_of(self, address: str) -> RedisServer:
        """The live replica of the master at `address`."""
        with self.by_address(address).client() as client:
            master_id = client.execute_command("CLUSTER", "MYID").decode()
            lines = client.execute_command("CLUSTER", "REPLICAS", master_id)
        for line in lines:
            fields = line.decode().split()
            if "fail" not in fields[2]:
                return self.by_address(fields[1].split("@")[0])
        raise RuntimeError(f"{address} has no live replica")

    def sync_replicas(self, timeout_s: float = 60) -> None:
        """Waits until each master's writes reached its replica (WAIT returns 1: a replica
        still in its first full sync, on loaded cores, acknowledges nothing yet)."""
        deadline = time.monotonic() + timeout_s
        for address in self.masters():
            with self.by_address(address).client() as client:
                while client.execute_command("WAIT", 1, 1000) < 1:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the replica of {address} never caught up")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
