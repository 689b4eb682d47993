"""Run `pagedserve serve` in a subprocess on a free loopback port, and read its /metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m pagedserve serve ARGS --port P`; waits for /health, logs to a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 wait: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", "pagedserve", "serve", *args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def read_metrics(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments skipped)."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def wait_for_metrics(url: str, predicate, timeout: float = 120.0) -> dict[str, float]:
    """Poll /metrics until predicate(metrics) holds; the last reading either way."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = read_metrics(url)
        if predicate(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)
