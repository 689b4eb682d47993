"""The server over an engine core process that dies mid-generation: requests in flight fail
with the engine's error (no hang), /health answers 503 within 10 s, new requests get 503, and
once the server stops no process is left. Runs the app in this process (uvicorn in a thread)
so the test holds the core process and can kill it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.llm_engine import LLMEngine
from tests.utils.paged import tiny_chat_model
from tests.utils.server import app_in_thread, child_pids, pid_alive, pids_gone


@pytest.fixture
def served(tmp_path):
    model = str(tiny_chat_model(tmp_path / "tiny"))
    engine = LLMEngine.from_kwargs(model=model, dtype="float32", kv_cache_memory="16MiB",
                                   engine_core_process=True)
    llm = AsyncLLM(engine)
    with app_in_thread(llm, "tiny") as url:
        yield url, engine, llm


def test_killed_core_fails_requests_and_health(served):
    url, engine, llm = served
    proc = engine.client.proc
    assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                      timeout=60).status_code == 200
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0}
    non_streamed: dict[str, httpx.Response] = {}
    waiter = threading.Thread(target=lambda: non_streamed.setdefault(
        "reply", httpx.post(url + "/v1/completions", json=body, timeout=60)))
    waiter.start()
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as resp:
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 2:
                    break
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        events += [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - killed < 10, "the stream hung after the core died"
    tail = [json.loads(e[6:]) for e in events[2:] if e != "data: [DONE]"]
    errors = [e["error"] for e in tail if "error" in e]
    assert errors and "engine" in errors[-1]["message"], tail[-3:]
    waiter.join(10)
    reply = non_streamed["reply"]
    assert reply.status_code == 503 and "engine" in reply.json()["error"]["message"]
    health = None
    while time.monotonic() - killed < 10:
        health = httpx.get(url + "/health", timeout=2)
        if health.status_code == 503:
            break
        time.sleep(0.1)
    assert health is not None and health.status_code == 503
    assert "engine core process died" in health.json()["error"]["message"]
    again = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                       timeout=10)
    assert again.status_code == 503
    assert not proc.is_alive()


@pytest.mark.slow  # the busy case covers /health
def test_idle_core_death_turns_health_503(served):
    """No request in flight: the death watcher alone must make /health fail."""
    url, engine, _ = served
    proc = engine.client.proc
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    while httpx.get(url + "/health", timeout=2).status_code != 503:
        assert time.monotonic() - killed < 10, "/health still 200 after the core died"
        time.sleep(0.1)


@pytest.mark.slow  # 30 s of server processes; deletion and fault tests cover it
@pytest.mark.parametrize("how", ["ctrl-c", "core killed"])
def test_real_server_leaves_no_process(tmp_path, how):
    """`pagedserve serve --engine-core-process`: Ctrl-C stops the server and its core; a core
    killed under it makes the server exit with status 1 (a supervisor restarts it)."""
    from tests.utils.server import ServerProcess

    model = str(tiny_chat_model(tmp_path / "tiny"))
    srv = ServerProcess(["--model", model, "--device", "cpu", "--dtype", "float32",
                         "--kv-cache-memory", "16MiB", "--engine-core-process",
                         "--shutdown-timeout", "2"], tmp_path / "server.log",
                        env={"PAGEDSERVE_PROCESS_START_METHOD": "spawn"})  # cores: children
    try:
        children = child_pids(srv.proc.pid)
        cores = [p for p in children if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        assert cores, children
        if how == "ctrl-c":
            srv.proc.send_signal(signal.SIGINT)
            assert srv.proc.wait(60) == 0
        else:
            for pid in cores:
                os.kill(pid, signal.SIGKILL)
            assert srv.proc.wait(30) == 1, srv.log()
        assert pids_gone(children, 15.0), [p for p in children if pid_alive(p)]
    finally:
        srv.stop()
