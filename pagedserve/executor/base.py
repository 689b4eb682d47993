"""What the engine calls on the model, wherever its ranks run.

The engine holds an `Executor` where it held a `ModelRunner`: the same calls (sizing and
allocating the cache, warm-up, requests in and out, `launch`/`collect` of a step) and the same
few attributes (`vocab_size`, `block_size`, `kv_specs`, `state_specs`, `backend`). Rank 0's
runner always lives in the engine's process and does what the engine asks, as it did before;
an executor with more ranks also tells the other ranks' workers each step (`StepMessage`), and
the ranks meet inside the forward in the layers' collectives.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.distributed import all_reduce_min
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.runner_outputs import ModelRunnerOutput, PendingStep
from pagedserve.scheduler import Request, SchedulerOutput


class WorkerError(RuntimeError):
    """A rank other than the engine's failed, died or stopped answering: the engine's state is
    unknown from here on (the server fails every open request and exits)."""


@dataclass
class StepMessage:
    """One step, as the other ranks need it: the scheduler's output with its requests named by
    id (`step`: every other field of SchedulerOutput, so what the scheduler adds to a step,
    an image's encoder schedule or a verify step's drafts, reaches every rank without being
    named here), and the requests they have not seen in this form (just admitted or resumed:
    a copy of the request as the scheduler has it, which carries its tokens and sampling
    settings). Ranks > 0 never sample, so nothing else of a request is sent."""

    request_ids: list[str]
    step: dict[str, Any]
    new_requests: list[Request]
    # Finished in the engine since the last step (the runner drops their generators).
    finished_request_ids: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, batch: SchedulerOutput, finished: list[str]) -> StepMessage:
        new = [_portable(r) for r, is_new in zip(batch.requests, batch.is_new, strict=True)
               if is_new]
        step = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
                if f.name != "requests"}
        return cls([r.request_id for r in batch.requests], step, new, finished)

    def output(self, requests: dict[str, Request]) -> SchedulerOutput:
        """The step over a worker's copies of the requests (by id)."""
        return SchedulerOutput([requests[i] for i in self.request_ids], **self.step)


def _portable(request: Request) -> Request:
    """A request as another process may hold it: without its grammar matcher (guided decoding
    is sampling, rank 0's alone)."""
    if request.grammar is None:
        return request
    request = copy.copy(request)
    request.grammar = None
    return request


class Executor:
    """Rank 0's runner in this process; subclasses add the other ranks. The methods are the
    runner's, as the engine calls them."""

    world_size = 1

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner: ModelRunner | None = None

    def start_runner(self, model: Any, vocab_size: int, max_model_len: int,
                     eos_token_id: int | None) -> None:
        """Rank 0's runner over the model shard this process loaded."""
        self.runner = ModelRunner(self.config, model, vocab_size, max_model_len, eos_token_id)

    def __getattr__(self, name: str) -> Any:
        # Only for names the executor lacks: rank 0's runner's (its model, caches and graphs,
        # which tests and benchmarks inspect).
        runner = self.__dict__.get("runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Likewise a runner setting the executor does not have itself (benchmarks switch on
        # the runner's step_log, tests swap its decode graphs).
        runner = self.__dict__.get("runner")
        if (runner is not None and name not in self.__dict__ and not hasattr(type(self), name)
                and hasattr(runner, name)):
            setattr(runner, name, value)
        else:
            super().__setattr__(name, value)

    # ---- what the engine reads ------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    @property
    def kv_specs(self) -> list[Any]:
        return self.runner.kv_specs

    @property
    def state_specs(self) -> list[Any]:
        return self.runner.state_specs

    @property
    def backend(self) -> Any:
        return self.runner.backend

    @property
    def structured_output(self) -> Any:
        return self.runner.structured_output

    @structured_output.setter
    def structured_output(self, manager: Any) -> None:
        self.runner.structured_output = manager

    # ---- what the engine calls ------------------------------------------------------------

    def determine_cache_size(self) -> tuple[int, int]:
        """(attention blocks, state slots) every rank's memory holds: each rank's budget is its
        own, and all must agree, so the smallest wins."""
        num_blocks, num_slots = self.runner.determine_cache_size()
        num_blocks, num_slots = all_reduce_min([num_blocks, num_slots], self.runner.device)
        return num_blocks, num_slots

    def allocate_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> None:
        self.runner.allocate_kv_cache(num_blocks, num_state_slots)

    def warmup(self) -> None:
        self.runner.warmup()

    def add_request(self, request: Request) -> None:
        self.runner.add_request(request)

    def finish_request(self, request_id: str) -> None:
        self.runner.finish_request(request_id)

    def launch(self, batch: SchedulerOutput) -> PendingStep:
        return self.runner.launch(batch)

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        return self.runner.collect(pending)

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(batch))

    def check_health(self) -> None:
        """Raise WorkerError if a rank has failed (nothing to check in one process)."""

    def shutdown(self) -> None:
        """Stop the other ranks; idempotent."""


class UniProcExecutor(Executor):
    """One rank, in the engine's process: the runner as it always ran."""
