"""The engine core in its own process (--engine-core-process) against the core in this one:
the same outputs to the last field (text cut at stop strings, logprobs, prompt logprobs,
seeded samples, scores), aborts that free the core's blocks, start-up errors that come back as
one line, a killed core that fails its requests instead of hanging, and no process left
behind."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError
from pagedserve.engine.core_client import EngineStartupError
from pagedserve.engine.core_process import decoder, encoder
from pagedserve.engine.llm_engine import LLMEngine
from tests.utils.paged import tiny_chat_model
from tests.utils.server import engine_core_pids

PROMPTS = ["The capital of France is", "Hello, my name is", "def fibonacci(n):",
           "Water boils at", "The quick brown fox"]


def _params(stops: tuple[str, str]) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=24, stop=[stops[0], "\u00a7\u00a7"],
                       logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10),
        SamplingParams(temperature=0, max_tokens=16, stop=[stops[1]],
                       include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1),
    ]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return str(tiny_chat_model(tmp_path_factory.mktemp("tiny_chat")))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    # A tiny model with the bundled tokenizer (text, stop strings, detokenization) and wide
    # random weights (greedy choices far from ties), float32.
    model = str(tiny_chat_model(tmp_path_factory.mktemp("tiny_wide"), init_std=0.2))
    common = dict(model=model, dtype="float32", kv_cache_memory="64MiB")
    core = LLM(engine_core_process=True, **common)
    here = LLM(engine_core_process=False, **common)
    yield here, core
    core.engine.shutdown()


@pytest.fixture(scope="module")
def stops(engines) -> tuple[str, str]:
    """Stop strings that occur mid-way in the greedy texts of prompts 0 and 3 (a random model
    writes no fixed text): two characters from the middle of each."""
    here, _ = engines
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    texts = [o.outputs[0].text for o in here.generate([PROMPTS[0], PROMPTS[3]], greedy,
                                                      use_tqdm=False)]
    picked = []
    for text in texts:
        middle = text[len(text) // 2:]
        picked.append(next(middle[i:i + 2] for i in range(len(middle) - 1)
                           if middle[i:i + 2].strip()))
    return picked[0], picked[1]


def _no_core_left(before: set[int], timeout: float = 15.0) -> bool:
    """No core process started since `before` (the module's shared core lives on) is alive,
    nor a zombie of one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine_core_pids() - before:
            return True
        time.sleep(0.1)
    return False


def _assert_close_logprobs(a, b) -> None:
    if a is None or b is None:
        assert a is b
        return
    assert len(a) == len(b)
    for pa, pb in zip(a, b, strict=True):
        if pa is None or pb is None:
            assert pa is pb
            continue
        assert list(pa) == list(pb)
        for tid, lp in pa.items():
            assert (lp.rank, lp.decoded_token) == (pb[tid].rank, pb[tid].decoded_token)
            assert lp.logprob == pytest.approx(pb[tid].logprob, abs=1e-4)


def test_outputs_identical_in_both_modes(engines, stops):
    here, core = engines
    assert not isinstance(here.engine.client, type(core.engine.client))
    a = here.generate(PROMPTS, _params(stops), use_tqdm=False)
    b = core.generate(PROMPTS, _params(stops), use_tqdm=False)
    stopped = 0
    for x, y in zip(a, b, strict=True):
        assert x.prompt_token_ids == y.prompt_token_ids
        assert x.prompt_logprobs == y.prompt_logprobs
        assert x.num_cached_tokens == y.num_cached_tokens
        assert len(x.outputs) == len(y.outputs)
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert (cx.text, cx.token_ids, cx.finish_reason, cx.stop_reason) == \
                (cy.text, cy.token_ids, cy.finish_reason, cy.stop_reason)
            # Float32 sums of the same step in another process (its own thread pool) may round
            # differently in the last bits; ids, ranks and texts are the same.
            _assert_close_logprobs(cx.logprobs, cy.logprobs)
            assert cx.cumulative_logprob == pytest.approx(cy.cumulative_logprob, abs=1e-4)
            stopped += isinstance(cx.stop_reason, str)
    assert a[1].prompt_logprobs is not None and len(a[1].prompt_logprobs) > 1
    assert a[0].outputs[0].logprobs  # the comparison above compared something
    # A stop string ended at least one sequence: its text is cut there, as in-process.
    assert stopped >= 1
    for params, x, y in zip(_params(stops), a, b, strict=True):
        for c in x.outputs + y.outputs:
            if isinstance(c.stop_reason, str):
                assert c.finish_reason == "stop"
                assert c.text.endswith(c.stop_reason) == params.include_stop_str_in_output
    assert core.engine.check_blocks_free()


def test_streamed_steps_identical_in_both_modes(engines):
    """Stepping add_request/step: the same deltas per request, in the same order per request."""
    deltas = []
    for llm in engines:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=["e"])
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"s-{i}", prompt, params)
        got: dict[str, list[tuple[str, bool]]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got.setdefault(out.request_id, []).append((out.outputs[0].delta_text,
                                                           out.finished))
        deltas.append(got)
    assert deltas[0] == deltas[1]
    assert all(steps[-1][1] for steps in deltas[0].values())


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_scores_identical_in_both_modes(engines, mode):
    here, core = engines
    prompts, continuations = [[1, 2, 3, 4], [5, 6]], [[7, 8, 9], [10, 11, 12, 13]]
    a = here.score(prompts, continuations, mode=mode)
    b = core.score(prompts, continuations, mode=mode)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == torch.float32 and x.shape == y.shape
        assert torch.equal(x, y)


def test_abort_frees_the_cores_blocks(engines):
    _, core = engines
    engine = core.engine
    engine.add_request("long", "Once upon a time", SamplingParams(max_tokens=200,
                                                                  ignore_eos=True))
    tokens = 0
    while tokens < 3:
        tokens = max([tokens] + [len(o.outputs[0].token_ids) for o in engine.step()])
    held = engine.call_utility("stats")
    assert held.num_free_blocks < held.num_blocks and not held.all_free
    engine.abort_request("long")
    stats = engine.call_utility("stats")  # the abort went first: blocks free within the step
    assert stats.all_free and stats.num_free_blocks == stats.num_blocks
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert not engine.has_unfinished_requests()


def test_async_llm_disconnect_frees_the_cores_blocks(tiny_dir):
    """A stream dropped mid-generation (a client disconnect) aborts in the core: its stats
    utility then reports every block free."""

    before = engine_core_pids()

    async def run() -> None:
        llm = AsyncLLM(LLMEngine.from_kwargs(model=tiny_dir, dtype="float32",
                                             kv_cache_memory="16MiB",
                                             engine_core_process=True))
        try:
            stream = await llm.add_request("r", "Hello there", SamplingParams(
                max_tokens=500, ignore_eos=True))
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
            held = await llm.call_utility("stats")
            assert not held.all_free
            stream.close()
            deadline = time.monotonic() + 10
            while not (stats := await llm.call_utility("stats")).all_free:
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.05)
            assert stats.num_running == 0
        finally:
            await asyncio.to_thread(llm.shutdown)

    asyncio.run(run())
    assert _no_core_left(before)


# The module's last test of `engines`: it kills the shared core (instead of starting one of
# its own); the fixture's shutdown then finds nothing left to do.
def test_killed_core_fails_pending_requests(engines):
    _, llm = engines
    engine = llm.engine
    proc = engine.client.proc
    before = engine_core_pids() - {proc.pid}
    engine.add_request("a", "Hello", SamplingParams(max_tokens=400, ignore_eos=True))
    while not engine.step():
        pass
    os.kill(proc.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="engine core process died"):
        while time.monotonic() - start < 30:
            engine.step()
    assert time.monotonic() - start < 10
    with pytest.raises(EngineDeadError):
        engine.add_request("b", "Hello", SamplingParams(max_tokens=2))
    engine.shutdown()
    assert not proc.is_alive()
    assert _no_core_left(before)


def test_startup_error_comes_back_as_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: no-such-base-model\n")
    before = engine_core_pids()
    start = time.monotonic()
    with pytest.raises((ValueError, EngineStartupError),
                       match="engine core failed to start") as info:
        LLM(model=f"random:{bad}", engine_core_process=True)
    assert "\n" not in str(info.value)
    assert time.monotonic() - start < 120
    assert _no_core_left(before)


@pytest.mark.slow  # test_startup_error_comes_back_as_one_line, through a CLI
def test_serve_reports_a_core_startup_error_in_one_line(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("base: no-such-base-model\n")
    done = subprocess.run([sys.executable, "-m", "pagedserve", "serve", "--model",
                           f"random:{bad}", "--device", "cpu", "--engine-core-process"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedserve serve: error: the engine core failed to start"), \
        done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_deleted_llm_leaves_no_process(tiny_dir):
    before = engine_core_pids()
    llm = LLM(model=tiny_dir, dtype="float32", kv_cache_memory="16MiB",
              engine_core_process=True)
    proc = llm.engine.client.proc
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    del llm
    gc.collect()
    proc.join(15)
    assert not proc.is_alive()
    assert _no_core_left(before)


def test_closed_llm_leaves_no_process_and_its_profile(tiny_dir, tmp_path, monkeypatch):
    """`with LLM(...)` closes the engine on leaving: its core process ends, and the LLM is
    unusable (a second close does nothing). PAGEDSERVE_CORE_PROFILE makes the core process
    write a cProfile of its loop when it stops, and its counters say how long its steps took
    and how much of that was waiting (one core start for both: each takes ~5 s)."""
    import pstats

    path = tmp_path / "core.prof"
    monkeypatch.setenv("PAGEDSERVE_CORE_PROFILE", str(path))
    before = engine_core_pids()
    with LLM(model=tiny_dir, dtype="float32", kv_cache_memory="16MiB",
             engine_core_process=True) as llm:
        proc = llm.engine.client.proc
        assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        stats = llm.engine.call_utility("stats")
        assert stats.num_steps >= 4 and stats.step_seconds > 0
        assert 0 <= stats.wait_seconds <= stats.step_seconds
    proc.join(15)
    assert not proc.is_alive()
    assert _no_core_left(before)
    with pytest.raises(AttributeError):
        llm.generate("Hi", use_tqdm=False)
    llm.close()
    deadline = time.monotonic() + 15
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    functions = {name for _, _, name in pstats.Stats(str(path)).stats}
    assert "step" in functions and "schedule" in functions


def test_arrays_cross_the_socket_as_bytes():
    import numpy as np

    from pagedserve.engine.core_messages import StepOutput

    out = StepOutput(["a", "b"], np.array([5, -1], np.int64),
                     logprobs=(np.ones((2, 3), np.float32), np.zeros((2, 3), np.int64),
                               np.array([1, 2])))
    data = encoder().encode({"output": out})
    assert b"numpy" not in data and len(data) < 200
    back = decoder(StepOutput).decode(encoder().encode(out))
    assert back.seq_ids == ["a", "b"] and back.tokens.tolist() == [5, -1]
    assert back.logprobs[0].dtype == np.float32 and back.logprobs[0].shape == (2, 3)


ORPHAN_SCRIPT = """
import sys, time
from pagedserve import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", kv_cache_memory="16MiB", engine_core_process=True)
engine = llm.engine
engine.add_request("a", "Hello", SamplingParams(max_tokens=400, ignore_eos=True))
while not engine.step():
    pass
print(engine.client.proc.pid, engine.client._dir, flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # 17 s; shutdown without a front is also covered by the deleted-LLM test
def test_core_exits_when_its_front_is_killed(tiny_dir, tmp_path):
    """SIGKILL of the front while the core is generating: the core notices within seconds
    (its output socket's peer is gone) and exits instead of running on as an orphan."""
    import subprocess
    import sys

    script = tmp_path / "front.py"
    script.write_text(ORPHAN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "PAGEDSERVE_PROCESS_START_METHOD": "spawn"}
    front = subprocess.Popen([sys.executable, str(script), tiny_dir], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        pid, sockets = front.stdout.readline().split()
        core_pid = int(pid)
    finally:
        front.kill()
        front.wait(30)
    deadline = time.monotonic() + 30
    while _pid_alive(core_pid):
        assert time.monotonic() < deadline, "the engine core outlived its front"
        time.sleep(0.2)
    assert not os.path.exists(sockets)  # the core removed its socket files


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.gpu
def test_cuda_core_process_matches_in_process():
    """On the GPU (async scheduling and CUDA graphs on): the core process gives the in-process
    engine's greedy tokens and texts, float32 so batching cannot round them apart; stop strings
    included (the core process learns of them a step later and must still report the same)."""
    from tests.utils.paged import bundled_gguf

    common = dict(model=str(bundled_gguf()), device="cuda", dtype="float32",
                  gpu_memory_utilization=0.3, max_num_seqs=64)
    prompts = [f"{p} {i}" for i in range(12) for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=48, stop=["."] if i % 3 == 0 else None,
                             ignore_eos=i % 2 == 0) for i in range(len(prompts))]
    results = []
    for core_process in (False, True):
        llm = LLM(engine_core_process=core_process, **common)
        results.append(llm.generate(prompts, params, use_tqdm=False))
        assert llm.engine.check_blocks_free()
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for a, b in zip(*results, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason) == \
            (cb.token_ids, cb.text, cb.finish_reason, cb.stop_reason)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["--no-engine-core-process", "--engine-core-process"])
def test_cuda_bench_throughput_in_both_modes(capsys, mode):
    from pagedserve.cli import main

    rc = main(["bench", "throughput", "--model", "random:tiny", "--device", "cuda",
               "--gpu-memory-utilization", "0.3", "--num-prompts", "64", "--input-len", "32",
               "--output-len", "32", mode])
    out = capsys.readouterr().out
    assert rc == 0 and "Total num output tokens: 2048" in out
