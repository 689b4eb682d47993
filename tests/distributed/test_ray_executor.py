"""Tensor parallelism through Ray: a local Ray of 3 CPUs, rank 1 a Ray actor in a placement
group, rank 0 in this process; greedy tokens of two ranks equal one rank's; an engine dropped
without close() frees the process for another."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve import LLM
from tests.distributed.test_tensor_parallel import CONFIGS, ENGINE, ROOT, greedy, save_model

ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_ray_two_ranks_match_one(tmp_path):
    path = save_model(CONFIGS["qwen3_moe"](), tmp_path / "model")
    expected = greedy(LLM(model=path, **ENGINE))
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(model=path, tensor_parallel_size=2, distributed_executor_backend="ray",
                  **ENGINE)
        try:
            assert llm.engine.runner.world_size == 2
            assert len(llm.engine.runner.actors) == 1
            assert greedy(llm) == expected
        finally:
            llm.engine.shutdown()
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ray_actor_stuck_in_a_step_is_a_clear_error(tmp_path, monkeypatch):
    """A stopped actor still looks alive to Ray: its unfinished step call marks it hung
    within the step timeout, it is killed, and rank 0's collective fails at once."""
    import os
    import signal
    import time

    from pagedserve import SamplingParams
    from pagedserve.executor import WorkerError
    from tests.distributed.test_tensor_parallel import PROMPTS

    monkeypatch.setenv("PAGEDSERVE_STEP_TIMEOUT_S", "3")
    monkeypatch.setenv("PAGEDSERVE_DIST_TIMEOUT_S", "60")
    path = save_model(CONFIGS["llama"](), tmp_path / "model")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    pid = None
    try:
        llm = LLM(model=path, tensor_parallel_size=2, distributed_executor_backend="ray",
                  **ENGINE)
        engine = llm.engine
        try:
            (actor,) = engine.runner.actors
            pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
            engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=100,
                                                               ignore_eos=True))
            for _ in range(3):
                engine.step()
            os.kill(pid, signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(WorkerError, match=r"rank 1 \(Ray actor\) has not finished "
                                                  r"step \d+.* in 3 s"):
                while engine.has_unfinished_requests():
                    engine.step()
            assert time.monotonic() - start < 15
        finally:
            engine.shutdown()
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        ray.shutdown()


# Run in a process of its own: one group per process, and the exit itself is checked.
DROPPED_ENGINE = """
import ray
import torch.distributed as dist
from ray.util import placement_group_table
from pagedserve import LLM, SamplingParams

ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
args = dict(model="random:tiny", tensor_parallel_size=2, distributed_executor_backend="ray",
            **{engine!r})
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
llm = LLM(**args)
first = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
placement = llm.engine.runner.placement
del llm  # neither close() nor gc.collect(): the last reference goes, and the engine with it
assert not dist.is_initialized(), "the group outlived the engine"
state = placement_group_table(placement)["state"]
assert state == "REMOVED", f"the actors' placement group is {{state}}"
llm = LLM(**args)
second = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
assert second == first, (first, second)
print("second engine ok")
"""  # the second engine is left to the interpreter's exit


@pytest.mark.slow
def test_dropped_ray_engine_frees_the_process_for_another():
    """`del llm` kills a Ray engine's actors, frees their placement group and leaves the
    group, as close() does: a second engine starts in the same process, which exits
    cleanly."""
    code = DROPPED_ENGINE.format(engine=ENGINE)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "second engine ok" in out.stdout
    assert "terminate called" not in out.stderr and "Traceback" not in out.stderr, out.stderr
