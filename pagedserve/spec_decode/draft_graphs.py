"""CUDA graphs for a proposer's one-token draft steps: a draft model's K steps, or a head's K - 1
after its catch-up pass, captured per padded row count through the engine's decode graphs
(engine/cuda_graphs.py: the padding, the graph-mode metadata, the start-up check, the head
graphs).

Each draft step is a pure decode of the live rows over the runner's block table, so the
target's decode-graph machinery serves it as it is: a `GraphInputs` whose model is the draft
(or the head) over input ids of the proposer's own (an `InputIds` of max_num_seqs entries)
and, for a head, its hidden-state input in a persistent buffer. Both are written on the device
just before each replay, from the step before's outputs, so nothing leaves the device between
steps. The greedy choice is in the graphs too (engine/head_graphs.py over the step's output):
only the ids come out; an EAGLE-3 head's ids, of its own smaller vocabulary, are mapped to the
target's after the graph (one gather).

The graphs also read the common metadata builder's and the backend builders' persistent
buffers, which the target's steps share: a draft step pads its metadata into them right
before its replay, and `propose_from` waits (its `copied` event, and the runner's
`_inputs_copied` for the launched step) until the copies queued from their pinned host side
have run before it rewrites them. Steps of more rows than the largest size run eagerly.

A head's catch-up pass after a uniform verify step (every request 1+K tokens) replays graphs
of that query length (the target's verify graphs' machinery, engine/verify_graphs.py) over
all 1+K positions of each request, its kept ones and those of its rejected drafts: the pass's
eager launches, a few hundred kernels at batch 1, become one replay. The K/V it writes past a
request's newest token is rewritten before anything reads it (see spec_decode/eagle.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.attention.forward_context import set_forward_context
from pagedserve.attention.layer import Attention
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.engine.cuda_graphs import (
    DecodeGraphs,
    GraphInputs,
    amplifies_rounding,
    graph_batch_sizes,
    setup_decode_graphs,
)
from pagedserve.engine.input_batch import InputIds
from pagedserve.engine.verify_graphs import (
    setup_verify_graphs,
    verify_batch_sizes,
    verify_query_len,
)

logger = logging.getLogger(__name__)

# The draft's forward over (input ids, positions, hidden input or None): its hidden states.
DraftForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# What the draft turns by, given the graph's [T] positions (an M-RoPE head: its [3, T] buffer).
GraphPositions = Callable[[torch.Tensor], torch.Tensor]


class DraftGraphs:
    """The draft steps' decode graphs over the proposer's own input buffers. `capture=False`
    keeps the padding and graph-mode metadata but runs the draft eagerly (no CUDA)."""

    def __init__(self, runner: Any, module: torch.nn.Module, forward: DraftForward,
                 logits: Callable[[torch.Tensor], torch.Tensor],
                 hidden_size: int | None = None, capture: bool = True,
                 positions: GraphPositions | None = None, catch_up: bool = False) -> None:
        n, device = runner.max_num_reqs, runner.device
        config = runner.config
        # A head's catch-up pass over a uniform verify step (1+K tokens a request) replays
        # graphs of that query length too (`catch_up`): its buffers hold their tokens.
        q = verify_query_len(config) if catch_up else None
        self.catch_up_sizes = verify_batch_sizes(config, q) if q is not None else []
        tokens = max([n, *(q * s for s in self.catch_up_sizes[-1:])])
        self._runner = runner
        self._forward = forward
        self._positions = positions
        self.ids = InputIds(tokens, n, device)
        self.hidden = (None if hidden_size is None
                       else torch.zeros(tokens, hidden_size, dtype=runner.dtype, device=device))
        # Only the draft's own layers' metadata (the target's builders may differ).
        keys = {m.metadata_key for m in module.modules() if isinstance(m, Attention)}
        builders = {key: b for key, b in runner.builders.items() if key in keys}
        self.inputs = GraphInputs(
            self._run_model, runner.common_builder, self.ids, builders,
            runner.num_blocks, runner.vocab_size,
            amplifies_rounding=amplifies_rounding(module),
            compute_logits=logits)
        self.sizes = graph_batch_sizes(config.scheduler.max_num_seqs,
                                       config.scheduler.max_num_batched_tokens,
                                       config.cuda_graph_sizes)
        # Without capture the padded path runs at once; with it, `capture` fills this in.
        self.decode = None if capture else DecodeGraphs(self.inputs, self.sizes, capture=False)
        if self.decode is not None and self.catch_up_sizes and q <= runner.block_size:
            self.decode.verify = DecodeGraphs(self.inputs, self.catch_up_sizes, capture=False,
                                              query_len=q)

    def _run_model(self, metadata: dict[Any, Any], num_tokens: int) -> torch.Tensor:
        """The draft over the first `num_tokens` persistent ids, positions (the common
        builder's) and hidden inputs: what a graph captures."""
        positions = self._runner.common_builder.dev["positions"][:num_tokens]
        if self._positions is not None:
            positions = self._positions(positions)
        hidden = None if self.hidden is None else self.hidden[:num_tokens]
        with set_forward_context(metadata, self._runner.kv_caches):
            return self._forward(self.ids.device[:num_tokens], positions, hidden)

    def capture(self) -> bool:
        """Capture every size and check it against the eager step (engine/cuda_graphs.py's
        start-up); on failure (logged there) nothing is kept and False is returned."""
        runner = self._runner
        if self.hidden is not None:  # the check's hidden inputs: fixed, not zeros
            g = torch.Generator().manual_seed(0)
            self.hidden.copy_(torch.randn(self.hidden.shape, generator=g))
        self.decode = setup_decode_graphs(self.inputs, runner.backend, runner.config,
                                          runner.max_model_len)
        if self.decode is not None and self.catch_up_sizes:  # (failing alone: logged there)
            if setup_verify_graphs(self.decode, runner.backend, runner.config) is not None:
                logger.info("the head's catch-up passes after uniform verify steps replay "
                            "CUDA graphs of %s requests", self.catch_up_sizes)
        return self.decode is not None

    # ---- per step -------------------------------------------------------------------------

    def prepare(self, common: CommonAttentionMetadata) -> int | None:
        """Pad the one-token step `common` (or a catch-up pass of 1+K tokens a request, with
        its graphs) into the graph buffers (host work and copies only); the size to replay,
        or None when it runs eagerly (then nothing was written)."""
        return None if self.decode is None else self.decode.prepare([common])

    @property
    def catches_up(self) -> bool:
        """Whether a uniform catch-up pass (1+K tokens a request) may replay a graph."""
        return self.decode is not None and self.decode.verify is not None

    def replay(self, size: int, ids: torch.Tensor, hidden: torch.Tensor | None = None,
               num_reqs: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prepared step over `ids` [n] (and a head's `hidden` inputs [n, H]): its hidden
        states [n, H] and greedy ids [n] of the draft's own vocabulary (None without the head
        graphs, as for a catch-up pass of `num_reqs` requests). Both are views of the graph's
        outputs, rewritten by the next replay: read them in work queued before it."""
        assert self.decode is not None
        n = len(ids)
        self.ids.device[:n].copy_(ids)
        if self.hidden is not None:
            self.hidden[:n].copy_(hidden)
        reqs = n if num_reqs is None else num_reqs
        out = self.decode.replay(size, reqs)
        return out, self.decode.greedy_tokens(reqs)

    @property
    def replays(self) -> int:
        return 0 if self.decode is None else sum(self.decode.replays.values())


def make_draft_graphs(runner: Any, module: torch.nn.Module, forward: DraftForward,
                      logits: Callable[[torch.Tensor], torch.Tensor],
                      hidden_size: int | None = None, capture: bool = True,
                      positions: GraphPositions | None = None,
                      catch_up: bool = False) -> DraftGraphs | None:
    """The proposer's draft graphs, or None where its steps run eagerly: on the CPU (unless
    `capture` is off, for tests), with --enforce-eager, a backend without graphs, or a failed
    capture or check (logged). `catch_up`: a head's catch-up passes over uniform verify steps
    get graphs too, where the target's verify steps could."""
    graphs = DraftGraphs(runner, module, forward, logits, hidden_size, capture, positions,
                         catch_up)
    if not capture:
        return graphs
    if not graphs.capture():
        logger.info("draft steps run eagerly (no CUDA graphs)")
        return None
    logger.info("draft steps replay CUDA graphs of %s rows", graphs.sizes)
    return graphs
