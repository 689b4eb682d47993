"""CUDA graphs for speculative decoding's verify steps: with K drafts configured, the forwards of
steps whose every request has q = 1+K new tokens (its last verified token, then its drafts),
captured per padded request count beside the decode graphs (`DecodeGraphs` with query_len q,
in the decode graphs' memory pool).

A verify step replays only when every request has exactly q tokens: a step with a prefill
chunk or a request with fewer drafts (the step budget, max_tokens, a grammar cut them short)
runs eagerly. Padding requests hold q tokens at positions 0..q-1 with slot -1 and read page 0
alone, which needs q <= block_size. The logits rows of a verify step are every real token's
hidden state, read by the eager head (no head graphs for them).

Only backends that declare their graph metadata right for several tokens a request
(`AttentionBackend.can_capture_verify`) get them, and only when no layer configuration's
builder declines them (`AttentionMetadataBuilder.verify_graph_reason`); a failed capture or
start-up check drops the verify graphs alone (the decode graphs stay).
"""

from __future__ import annotations

import logging

import torch

from pagedserve.attention import AttentionBackend
from pagedserve.config import EngineConfig
from pagedserve.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes

logger = logging.getLogger(__name__)


def verify_query_len(config: EngineConfig) -> int | None:
    """q = 1+K of the configured speculation, None without it."""
    spec = config.speculative
    return None if spec is None else 1 + spec.num_speculative_tokens


def verify_batch_sizes(config: EngineConfig, query_len: int) -> list[int]:
    """Padded request counts to capture: the decode graphs' sizes whose q tokens a request
    fit a step's token budget."""
    sched = config.scheduler
    return graph_batch_sizes(sched.max_num_seqs, sched.max_num_batched_tokens // query_len,
                             config.cuda_graph_sizes)


def largest_graph_tokens(config: EngineConfig) -> int:
    """Tokens of the largest decode or verify graph the engine may capture (what a buffer
    that such graphs write must hold)."""
    sched = config.scheduler
    decode = graph_batch_sizes(sched.max_num_seqs, sched.max_num_batched_tokens,
                               config.cuda_graph_sizes)
    q = verify_query_len(config)
    verify = verify_batch_sizes(config, q) if q is not None else []
    return max([0, *decode[-1:], *(q * s for s in verify[-1:])])


def setup_verify_graphs(decode: DecodeGraphs | None, backend: type[AttentionBackend],
                        config: EngineConfig) -> DecodeGraphs | None:
    """Capture and check the verify graphs next to the captured `decode` graphs (which then
    dispatch verify steps to them: `decode.verify`); None, logged, when they are not made
    (and when there are no decode graphs: the engine runs eagerly)."""
    q = verify_query_len(config)
    if q is None or decode is None:
        return None
    block_size = decode.inputs.common_builder.block_size
    if not backend.can_capture_verify(block_size):
        logger.info("verify steps run eagerly: the %s backend captures decode steps only",
                    backend.get_name())
        return None
    reasons = sorted({r for b in decode.inputs.builders.values()
                      if (r := b.verify_graph_reason()) is not None})
    if reasons:
        logger.info("verify steps run eagerly: %s", "; ".join(reasons))
        return None
    if q > block_size:
        logger.info("verify steps run eagerly: %d tokens a request exceed the block size %d "
                    "(a padding request reads one page)", q, block_size)
        return None
    sizes = verify_batch_sizes(config, q)
    if not sizes:
        return None
    graphs = DecodeGraphs(decode.inputs, sizes, query_len=q)
    try:
        graphs.capture_all(pool=decode.memory_pool)
        diff = graphs.check_against_eager()
    except Exception as exc:
        logger.warning("CUDA graphs of verify steps failed, they run eagerly (decode graphs "
                       "stay): %s: %s", type(exc).__name__, exc)
        graphs.graphs.clear()
        graphs.outputs.clear()
        try:
            torch.cuda.synchronize(decode.inputs.common_builder.device)
        except Exception as sync_exc:  # a broken context is reported by the next step anyway
            logger.warning("after the failed capture: %s", sync_exc)
        return None
    logger.info("verify graphs match the eager forward (max diff %.2g relative)", diff)
    decode.verify = graphs
    return graphs
