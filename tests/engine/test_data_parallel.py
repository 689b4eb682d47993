"""Data parallelism (--data-parallel-size N): N engine core processes behind one front give the
one-core engine's outputs, spread the requests over the cores, free every block on abort, fail
as one engine when a core dies, and leave no process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import EngineDeadError
from pagedserve.engine.dp_client import DPClient, core_configs
from tests.utils.paged import tiny_chat_model
from tests.utils.server import engine_core_pids

PROMPTS = ["The capital of France is", "Hello, my name is", "def fibonacci(n):",
           "Water boils at", "The quick brown fox", "Once upon a time"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = str(tiny_chat_model(tmp_path_factory.mktemp("tiny_dp"), init_std=0.2))
    common = dict(model=model, dtype="float32", kv_cache_memory="32MiB")
    here = LLM(engine_core_process=False, **common)
    dp = LLM(data_parallel_size=2, **common)
    yield here, dp
    dp.engine.shutdown()


def test_outputs_match_one_core_and_both_cores_work(engines):
    here, dp = engines
    assert isinstance(dp.engine.client, DPClient) and len(dp.engine.client.clients) == 2
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=8),
              SamplingParams(temperature=0, max_tokens=10, stop=["e"])] * 2
    a = here.generate(PROMPTS, params, use_tqdm=False)
    b = dp.generate(PROMPTS, params, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in x.outputs] == \
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in y.outputs]
    per_core = [c.call_utility("stats") for c in dp.engine.client.clients]
    assert all(s.generation_tokens > 0 for s in per_core)  # the requests were spread
    merged = dp.engine.call_utility("stats")
    assert merged.generation_tokens == sum(s.generation_tokens for s in per_core)
    assert merged.num_blocks == sum(s.num_blocks for s in per_core)
    assert dp.engine.check_blocks_free()


def test_abort_frees_blocks_on_the_owning_core(engines):
    _, dp = engines
    engine = dp.engine
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"long-{i}", PROMPTS[i], params)
    tokens = 0
    while tokens < 3:
        tokens = max([tokens] + [len(o.outputs[0].token_ids) for o in engine.step()])
    assert not engine.call_utility("stats").all_free
    engine.abort_request([f"long-{i}" for i in range(3)])
    stats = engine.call_utility("stats")  # the aborts went first: blocks free at once
    assert stats.all_free and stats.num_running == 0 and stats.num_waiting == 0
    assert not engine.has_unfinished_requests()
    assert engine.client._load == [0, 0]


# The module's last test of `engines`: it kills the data-parallel engine's core (a start of
# two cores of its own took 7 s); the fixture's shutdown then finds nothing left to do.
def test_a_killed_core_fails_the_engine_and_no_process_is_left(engines):
    _, llm = engines
    engine = llm.engine
    started = {c.proc.pid for c in engine.client.clients}
    assert len(started) == 2 and started <= engine_core_pids()
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True))
    os.kill(engine.client.clients[1].proc.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="died"):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            engine.step()
    engine.shutdown()
    deadline = time.monotonic() + 15
    while engine_core_pids() & started and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not engine_core_pids() & started


def test_settings_are_checked():
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        EngineConfig.from_kwargs(data_parallel_size=0)
    with pytest.raises(ValueError, match="no-engine-core-process"):
        EngineConfig.from_kwargs(data_parallel_size=2, engine_core_process=False)
    cpu = EngineConfig.from_kwargs(data_parallel_size=3, device="cpu")
    assert cpu.use_engine_core_process
    assert [c.data_parallel_size for c in core_configs(cpu)] == [1, 1, 1]
    import torch

    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="needs 64 GPUs"):
            core_configs(EngineConfig.from_kwargs(data_parallel_size=32, device="cuda",
                                                  tensor_parallel_size=2))
