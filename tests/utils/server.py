"""Run `pagedserve serve` in a subprocess on a free loopback port (or the app in a thread of
this process, for tests that must hold the engine), read its /metrics, and list the engine core
processes this process started."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


def engine_core_pids() -> set[int]:
    """The engine core processes (children of this process) alive now."""
    return {p.pid for p in multiprocessing.active_children()
            if p.name == "pagedserve-engine-core"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_gone(pids: list[int], timeout: float = 10.0) -> bool:
    """Whether every process of `pids` has ended within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(pid_alive(p) for p in pids)


@contextmanager
def app_in_thread(llm: Any, served_model_name: str, timeout: float = 60.0,
                  **server_settings: Any) -> Iterator[str]:
    """The server's app over `llm` (an AsyncLLM) under uvicorn in a thread of this process,
    healthy; yields its URL and stops it on leaving. `server_settings`: ServerConfig fields."""
    import uvicorn

    from pagedserve.server.api import build_app
    from pagedserve.server_config import ServerConfig

    app = build_app(llm, ServerConfig(served_model_name=served_model_name, **server_settings))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()


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

    def healthy_after(self, work: Callable[[], T]) -> T:
        """`work()` while the server starts (a reference computed as its model loads), then
        its health; the server is stopped if either fails. Returns what `work` returned."""
        try:
            result = work()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return result

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
            time.sleep(0.1)  # a refused connection costs nothing; each start waits less
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
