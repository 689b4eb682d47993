"""A tensor-parallel worker that hangs, rather than dies, is a clear error within seconds, not
after the group's timeout: one that stops answering (SIGSTOP) is caught by its missing
heartbeat, one that still beats but never finishes a step by the step timeout; either is
killed so rank 0's collective fails at once, and the engine's WorkerError names the rank and
why (not the kill's exit code). Behind a server the same error fails the request in flight
and /health. The progress bookkeeping is checked on its own first."""

from __future__ import annotations

import os
import signal
import time
from multiprocessing import forkserver

import httpx
import pytest

from pagedserve import LLM, SamplingParams, envs, process_start
from pagedserve.executor import WorkerError, multiproc
from pagedserve.executor.progress import StepProgress
from tests.distributed.hang_hooks import STUCK_AT, worker_main_stuck_at_launch
from tests.distributed.test_tensor_parallel import CONFIGS, ENGINE, PROMPTS, save_model
from tests.utils.server import app_in_thread, child_pids, pid_alive, pids_gone

LONG = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

# ---- the bookkeeping ------------------------------------------------------------------------


def test_progress_reports_the_rank_furthest_behind():
    p = StepProgress([1, 2])
    p.sent("launch", now=0.0)
    p.sent("collect", now=1.0)
    p.sent("launch", now=2.0)
    assert p.overdue(5.0, now=4.9) is None  # the oldest is 4.9 s old: not yet
    late = p.overdue(5.0, now=6.5)
    assert (late.rank, late.kind, late.step) == (1, "launch", 1)
    assert late.describe() == "has not finished step 1 in 6 s"
    p.done(1, 2)  # rank 1 finished launch 1 and collect 1; rank 2 nothing
    late = p.overdue(5.0, now=6.5)
    assert (late.rank, late.kind, late.step) == (2, "launch", 1)
    p.done(2, 3)  # rank 2 is ahead now; rank 1's oldest is launch 2, sent at 2.0
    assert p.overdue(5.0, now=6.5) is None
    late = p.overdue(5.0, now=7.5)
    assert (late.rank, late.kind, late.step, late.age_s) == (1, "launch", 2, 5.5)
    p.done(1, 3)
    assert p.overdue(5.0, now=100.0) is None  # nothing in flight


def test_progress_forgets_finished_commands_and_gone_ranks():
    p = StepProgress([1, 2])
    for i in range(10):
        p.sent("launch" if i % 2 == 0 else "collect", now=float(i))
    p.done(1, 10)
    assert p.in_flight() == 10  # rank 2 has finished none: all kept
    p.done(2, 4)
    assert p.in_flight() == 6  # finished by both: gone
    p.done(2, 3)  # an older report (counts only grow) changes nothing
    assert p.in_flight() == 6
    late = p.overdue(1.0, now=20.0)
    assert (late.rank, late.kind, late.step) == (2, "launch", 3)
    assert late.describe() == "has not finished step 3 in 16 s"
    p.done(2, 5)
    assert p.overdue(1.0, now=20.0).describe() == "has not finished step 3's collect in 15 s"
    p.forget(2)  # rank 2 died: its failure is reported already, rank 1 is up to date
    assert p.overdue(1.0, now=20.0) is None
    p.sent("launch", now=21.0)
    assert p.overdue(1.0, now=23.0).rank == 1


# ---- worker processes ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_model(CONFIGS["llama"](), tmp_path_factory.mktemp("llama"))


def _release(pids: list[int]) -> None:
    """Whatever the test's outcome, no stopped or stuck process stays behind."""
    for pid in pids:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)  # a stopped process dies of it too
            except ProcessLookupError:
                pass


def _fails_within(engine, seconds: float) -> WorkerError:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < seconds, f"took {time.monotonic() - start:.1f} s"
    return info.value


def test_stopped_worker_is_a_clear_error(model_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_WORKER_HEARTBEAT_TIMEOUT_S", "2")
    monkeypatch.setenv("PAGEDSERVE_DIST_TIMEOUT_S", "60")  # far beyond what the test allows
    llm = LLM(model=model_path, tensor_parallel_size=2, **ENGINE)
    engine = llm.engine
    (worker,) = engine.runner.processes
    try:
        engine.add_request("r", PROMPTS[0], LONG)
        for _ in range(3):
            engine.step()
        os.kill(worker.pid, signal.SIGSTOP)
        error = _fails_within(engine, 10)
        message = str(error)
        assert f"rank 1 (pid {worker.pid}) stopped responding: no heartbeat for 2 s" in message
        assert "exited with code" not in message
        assert pids_gone([worker.pid])
    finally:
        _release([worker.pid])
        engine.shutdown()


def test_worker_stuck_in_a_step_is_a_clear_error(model_path, monkeypatch):
    """Rank 1 still beats, but its 5th step never finishes. The step's number is set after
    the workers' forkserver (the tests') is running: the worker reads it from the engine's
    environment, handed over."""
    if envs.PAGEDSERVE_PROCESS_START_METHOD == "forkserver":
        process_start.start_context()  # its preload, as the engines before this one had it
        forkserver.ensure_running()
    monkeypatch.setenv(STUCK_AT, "5")
    monkeypatch.setenv("PAGEDSERVE_STEP_TIMEOUT_S", "3")
    monkeypatch.setenv("PAGEDSERVE_DIST_TIMEOUT_S", "60")
    monkeypatch.setattr(multiproc, "worker_main", worker_main_stuck_at_launch)
    llm = LLM(model=model_path, tensor_parallel_size=2, **ENGINE)
    engine = llm.engine
    (worker,) = engine.runner.processes
    try:
        engine.add_request("r", PROMPTS[0], LONG)
        error = _fails_within(engine, 10)
        message = str(error)
        assert f"rank 1 (pid {worker.pid}) has not finished step 5 in 3 s" in message
        assert "heartbeat" not in message and "exited with code" not in message
        assert pids_gone([worker.pid])
    finally:
        _release([worker.pid])
        engine.shutdown()


@pytest.mark.slow  # the served core process test (slow) covers an idle hang too
def test_idle_engine_fails_once_a_worker_stops(model_path, monkeypatch):
    """No request in flight: AsyncLLM's idle engine thread still checks on the ranks, so its
    error (which /health reports) is set within seconds."""
    from pagedserve.engine.async_llm import AsyncLLM

    monkeypatch.setenv("PAGEDSERVE_WORKER_HEARTBEAT_TIMEOUT_S", "2")
    llm = AsyncLLM.from_kwargs(model=model_path, tensor_parallel_size=2, **ENGINE)
    (worker,) = llm.engine.runner.processes
    llm.start()
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while llm.error is None:
            assert time.monotonic() - stopped < 8, "still healthy after the worker stopped"
            time.sleep(0.1)
        assert isinstance(llm.error, WorkerError)
        assert "rank 1" in str(llm.error) and "no heartbeat" in str(llm.error)
        assert pids_gone([worker.pid])
    finally:
        _release([worker.pid])
        llm.shutdown()


# ---- behind the engine core process and the server --------------------------------------


@pytest.mark.slow  # 25 s, most of it starting the core process and its worker
@pytest.mark.parametrize("when", ["streaming", "idle"])
def test_stopped_worker_fails_requests_and_health(model_path, monkeypatch, when):
    """TP=2 behind an engine core process, served: a worker stopped while a request streams
    fails that request with the hang's message, or while the engine idles fails it all the
    same (the core loop checks on the ranks); /health answers 503 within seconds."""
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm_engine import LLMEngine

    monkeypatch.setenv("PAGEDSERVE_WORKER_HEARTBEAT_TIMEOUT_S", "2")
    monkeypatch.setenv("PAGEDSERVE_DIST_TIMEOUT_S", "60")
    monkeypatch.setenv("PAGEDSERVE_PROCESS_START_METHOD", "spawn")  # the worker: the core's
    engine = LLMEngine.from_kwargs(model=model_path, tensor_parallel_size=2,
                                   engine_core_process=True, **ENGINE)
    core = engine.client.proc
    (worker,) = child_pids(core.pid)
    llm = AsyncLLM(engine)
    try:
        with app_in_thread(llm, "m", timeout=30) as url:
            body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            if when == "streaming":
                with httpx.stream("POST", url + "/v1/completions", json=body,
                                  timeout=30) as resp:
                    lines = resp.iter_lines()
                    for line in lines:
                        if line.startswith("data: "):
                            break  # generating
                    os.kill(worker, signal.SIGSTOP)
                    stopped = time.monotonic()
                    tail = [line for line in lines if line.startswith("data: ")]
                assert time.monotonic() - stopped < 15, "the stream hung after the worker stopped"
                assert any("heartbeat" in line and "rank 1" in line for line in tail), tail[-3:]
            else:
                os.kill(worker, signal.SIGSTOP)
                stopped = time.monotonic()
            while (health := httpx.get(url + "/health", timeout=2)).status_code != 503:
                assert time.monotonic() - stopped < 15, "/health still 200 after the hang"
                time.sleep(0.1)
            assert "no heartbeat" in health.json()["error"]["message"]
            again = httpx.post(url + "/v1/completions", json={**body, "stream": False},
                               timeout=10)
            assert again.status_code == 503
    finally:
        _release([worker])
        engine.shutdown()
    assert pids_gone([worker, core.pid])
