"""Tensor parallelism on two GPUs (NCCL), as the engine runs there by default (asynchronous
scheduling, decode steps replayed from CUDA graphs with the collectives captured in them):
greedy tokens of two ranks equal one rank's in float32, for a dense model and a
Mixture-of-Experts one (the Triton grouped GEMM over each rank's share of the experts), and
through Ray; a worker killed, stopped (no heartbeat) or stuck in a step (its NCCL peer waits
in the collective) mid-generation is a WorkerError within seconds."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import time

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.executor import WorkerError, multiproc
from tests.distributed.hang_hooks import worker_main_stuck_at_launch
from tests.distributed.test_tensor_parallel import CONFIGS, PROMPTS, save_model

pytestmark = pytest.mark.gpu

ENGINE = dict(dtype="float32", device="cuda", gpu_memory_utilization=0.3, max_model_len=128,
              block_size=16, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _need_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_two_gpus_match_one(tmp_path, name):
    _need_two_gpus()
    path = save_model(CONFIGS[name](), tmp_path / name)
    one = LLM(model=path, **ENGINE)
    expected = _greedy(one)
    del one
    torch.cuda.empty_cache()
    llm = LLM(model=path, tensor_parallel_size=2, **ENGINE)
    try:
        assert llm.engine.runner.decode_graphs is not None  # graphs captured on every rank
        assert _greedy(llm) == expected
    finally:
        llm.engine.shutdown()


def test_ray_two_gpus_match_one(tmp_path):
    """Ray on CUDA: rank 0 takes the GPU of the placement group's first bundle, rank 1 an
    actor on the second."""
    _need_two_gpus()
    ray = pytest.importorskip("ray")
    path = save_model(CONFIGS["qwen3"](), tmp_path / "qwen3")
    one = LLM(model=path, **ENGINE)
    expected = _greedy(one)
    del one
    torch.cuda.empty_cache()
    ray.init(num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(model=path, tensor_parallel_size=2, distributed_executor_backend="ray",
                  **ENGINE)
        try:
            assert _greedy(llm) == expected
        finally:
            llm.engine.shutdown()
    finally:
        ray.shutdown()


def test_killed_gpu_worker_is_a_clear_error(tmp_path):
    _need_two_gpus()
    path = save_model(CONFIGS["llama"](), tmp_path / "llama")
    llm = LLM(model=path, tensor_parallel_size=2, **ENGINE)
    engine = llm.engine
    (worker,) = engine.runner.processes
    engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=100,
                                                       ignore_eos=True))
    for _ in range(3):
        engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("how", ["stopped", "stuck"])
def test_hung_gpu_worker_is_a_clear_error(tmp_path, monkeypatch, how):
    """Rank 0 waits on the step's event while rank 1's half of the collective never comes:
    the monitor declares rank 1 hung (no heartbeat; its 6th step unfinished), kills it, and
    rank 0 stops waiting (its NCCL group aborted)."""
    _need_two_gpus()
    monkeypatch.setenv("PAGEDSERVE_WORKER_HEARTBEAT_TIMEOUT_S", "2")
    monkeypatch.setenv("PAGEDSERVE_STEP_TIMEOUT_S", "3")
    if how == "stuck":
        monkeypatch.setattr(multiproc, "worker_main",
                            functools.partial(worker_main_stuck_at_launch, 6))
    path = save_model(CONFIGS["llama"](), tmp_path / "llama")
    llm = LLM(model=path, tensor_parallel_size=2, **ENGINE)
    engine = llm.engine
    (worker,) = engine.runner.processes
    try:
        engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=100,
                                                           ignore_eos=True))
        for _ in range(3):
            engine.step()
        if how == "stopped":
            os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        expected = "no heartbeat for 2 s" if how == "stopped" else "has not finished step 6"
        with pytest.raises(WorkerError, match=f"rank 1 .*{expected}"):
            while engine.has_unfinished_requests():
                engine.step()
        print(f"\n{how}: WorkerError {time.monotonic() - start:.1f} s after the hang")
        assert time.monotonic() - start < 15
        assert not multiprocessing.active_children()
    finally:
        if worker.is_alive():
            worker.kill()
        engine.shutdown()
