"""ServerProcess: a `mokv serve` or `max serve` process on 127.0.0.1, started, waited for and
stopped, for tests, benchmarks and `make serve`'s smoke check.

    with ServerProcess("mokv", ["--model", "tiny/", "--devices", "cpu"], log="serve.log") as s:
        openai.OpenAI(base_url=s.base_url, api_key="-").completions.create(...)

Each process gets free ports of its own (the API's and the metrics endpoint's, which
`max serve` otherwise fixes at 8000 and 8001), the model hub offline, and the
environment of this Python process (MAX's native code edits the C-level
environment of a process that imported it; children get `os.environ` explicitly).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

PROGRAMS = {
    "mokv": ["-m", "mokv.pipelines.serve", "serve"],
    "max": ["-m", "max._entrypoints.pipelines", "serve"],
}
"""How each server starts, after the Python interpreter."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A `mokv serve` (`program="mokv"`) or `max serve` (`"max"`) subprocess.

    Args:
        program: "mokv" or "max".
        args: the server's options (`--model DIR ...`); host and port are added.
        log: file the server's output goes to (read back by `log_text`).
        env: variables added to this process's environment.
    """

    def __init__(
        self,
        program: str,
        args: Sequence[str],
        log: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
    ) -> None:
        if program not in PROGRAMS:
            raise ValueError(f"program must be one of {sorted(PROGRAMS)}, got {program!r}")
        self.program = program
        self.port = free_port()
        self.metrics_port = free_port()
        self.log_path = Path(log)
        self.command = [
            sys.executable,
            *PROGRAMS[program],
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.env = {
            **os.environ,
            "MAX_SERVE_METRICS_ENDPOINT_PORT": str(self.metrics_port),
            "HF_HUB_OFFLINE": "1",
            **(env or {}),
        }
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI API's base URL (`openai.OpenAI(base_url=...)`)."""
        return f"{self.url}/v1"

    def start(self, timeout_s: float = 1200.0) -> ServerProcess:
        """Starts the server and waits until it answers `/health` (a cold start compiles
        the model: minutes). RuntimeError with the log's tail if it exits or times out."""
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"{self.program} serve exited:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.program} serve not ready in {timeout_s} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server's process group (its API server and model worker), then
        SIGKILL after `grace_s`."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-num_lines:])

    def metric(self, name: str, **labels: str) -> float | None:
        """The value of one Prometheus series on the server's metrics endpoint
        (`maxserve_cache_num_used_blocks`; `maxserve_cache_hits_tokens_total`,
        tier="external"),
        or None if it has none yet."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as response:
            text = response.read().decode()
        wanted = [f'{key}="{value}"' for key, value in labels.items()]
        for line in text.splitlines():
            series, _, value = line.rpartition(" ")
            if series.partition("{")[0] == name and all(w in series for w in wanted):
                return float(value)
        return None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
