"""What a ModelRunner runs before its first request: forwards over stand-in requests (for the
memory profile, `kv_cache_setup.profile_peak_memory`) and the backend's warm-up steps through
the whole model, so that what the backend compiles per kind of step compiles at start-up;
then the CUDA graphs its steps replay (`capture_graphs`, and `graph_inputs`: what they read).
`runner`: the ModelRunner (its forward, its row table and limits)."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from pagedserve.engine.cuda_graphs import GraphInputs, amplifies_rounding, setup_decode_graphs
from pagedserve.engine.input_batch import InputBatch
from pagedserve.engine.piecewise_graphs import setup_piecewise_graphs
from pagedserve.engine.verify_graphs import largest_graph_tokens, setup_verify_graphs
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Request, SchedulerOutput

logger = logging.getLogger(__name__)


def dummy_forward(runner: Any, num_reqs: int, num_new: int, context: int
                  ) -> torch.Tensor:
    """A forward over `num_reqs` stand-in requests of `context` cached and `num_new` new
    tokens each, on pages 0, 1, ... of the cache (no request holds them yet; every KV
    cache group gets the same ids, and groups that share cache tensors overwrite each
    other's writes: nothing reads them) and state slot 0, in a row table of their own."""
    total = context + num_new
    pages = -(-total // runner.block_size) if runner.attn_layers else 0
    table = InputBatch(num_reqs, runner.max_model_len, runner.max_blocks_per_seq,
                       runner.num_kv_groups)
    requests, block_ids, rows = [], [], []
    for i in range(num_reqs):
        request = Request(f"__dummy_{i}__", [0] * total, SamplingParams(max_tokens=1))
        request.state_slot = 0 if runner.state_layers else -1
        ids = tuple(list(range(i * pages, (i + 1) * pages))
                    for _ in range(runner.num_kv_groups))
        rows.append(table.add(request, ids))
        requests.append(request)
        block_ids.append(ids)
    batch = SchedulerOutput(requests, np.full(num_reqs, num_new, dtype=np.int32),
                            np.full(num_reqs, context, dtype=np.int32), block_ids,
                            [False] * num_reqs, num_reqs if num_new > 1 else 0,
                            np.ones(num_reqs, dtype=bool))
    saved, runner.input_batch = runner.input_batch, table
    try:
        return runner._forward(batch, np.array(rows, dtype=np.int64))
    finally:
        runner.input_batch = saved


@torch.inference_mode()
def run_warmup_steps(runner: Any) -> None:
    """The backend's warm-up steps (`AttentionBackend.warmup_steps`) through the whole
    model, those that fit this engine's limits and its cache: what the backend compiles
    per kind of step compiles now, not in the first request."""
    t0 = time.perf_counter()
    ran = 0
    for num_reqs, num_new, context in runner.backend.warmup_steps(runner.device):
        pages = num_reqs * -(-(context + num_new) // runner.block_size) \
            if runner.kv_layout is not None else 0
        if runner.encoder_only and context:  # an encoder request runs whole: no cached part
            continue
        if (num_reqs > runner.max_num_reqs or num_reqs * num_new > runner.max_num_tokens
                or context + num_new > runner.max_model_len or pages > runner.num_blocks
                or (runner.state_layers and runner.num_state_slots < 1)):
            continue
        runner._dummy_forward(num_reqs, num_new, context)
        ran += 1
    if ran:
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        logger.info("%s: %d warm-up steps in %.1f s", runner.backend.get_name(), ran,
                    time.perf_counter() - t0)


def capture_graphs(runner: Any) -> None:
    """The CUDA graphs the runner's steps may replay: the decode steps' and the uniform
    verify steps' (1 + K tokens each), and with a draft model or head its one-token draft
    steps' too; the target's graphed steps then also hold the proposer's part of the step
    (spec_decode/step_graphs.py). Steps of models with state layers run eagerly (a graph
    would need a scratch slot for its padding rows); a pooling model never decodes. Then,
    when configured, the other steps' piecewise graphs (engine/piecewise_graphs.py)."""
    if not runner.state_layers and runner.pooler is None:
        speculator = runner.speculator
        if speculator is not None and speculator.uses_kv_cache:
            speculator.proposer.setup_graphs(runner)
            speculator.graph_step.bind(runner.backend, runner.kv_caches,
                                       largest_graph_tokens(runner.config))
        runner.decode_graphs = setup_decode_graphs(runner.graph_inputs(), runner.backend,
                                                   runner.config, runner.max_model_len)
        setup_verify_graphs(runner.decode_graphs, runner.backend, runner.config)
    runner.piecewise = setup_piecewise_graphs(runner)


def graph_inputs(runner: Any) -> GraphInputs:
    """What the runner's graphs read and write of it (`GraphInputs`)."""
    head = runner.model.compute_logits if runner.tp_size == 1 else None
    spec = (runner.speculator if runner.speculator and runner.speculator.uses_kv_cache
            else None)
    return GraphInputs(runner.run_model, runner.common_builder, runner.input_ids,
                       runner.builders, runner.num_blocks, runner.vocab_size,
                       amplifies_rounding=amplifies_rounding(runner.model),
                       group_builders=runner.group_builders,
                       builder_group=runner.builder_group, compute_logits=head,
                       lora=runner.lora.batch if runner.lora is not None else None,
                       after_replay=spec.replayed if spec else None,
                       step_outputs=spec.graph_step if spec else None)
