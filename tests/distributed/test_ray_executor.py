"""Tensor parallelism through Ray: a local Ray of 3 CPUs, rank 1 a Ray actor in a placement
group, rank 0 in this process; greedy tokens of two ranks equal one rank's."""

from __future__ import annotations

import pytest

from pagedserve import LLM
from tests.distributed.test_tensor_parallel import CONFIGS, ENGINE, greedy, save_model

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
