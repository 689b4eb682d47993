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
                 positions: GraphPositions | None = None) -> None:
        n, device = runner.max_num_reqs, runner.device
        self._runner = runner
        self._forward = forward
        self._positions = positions
        self.ids = InputIds(n, n, device)
        self.hidden = (None if hidden_size is None
                       else torch.zeros(n, hidden_size, dtype=runner.dtype, device=device))
        # Only the draft's own layers' metadata (the target's builders may differ).
        keys = {m.metadata_key for m in module.modules() if isinstance(m, Attention)}
        builders = {key: b for key, b in runner.builders.items() if key in keys}
        self.inputs = GraphInputs(
            self._run_model, runner.common_builder, self.ids, builders,
            runner.num_blocks, runner.vocab_size,
            amplifies_rounding=amplifies_rounding(module),
            compute_logits=logits)
        config = runner.config
        self.sizes = graph_batch_sizes(config.scheduler.max_num_seqs,
                                       config.scheduler.max_num_batched_tokens,
                                       config.cuda_graph_sizes)
        # Without capture the padded path runs at once; with it, `capture` fills this in.
        self.decode = None if capture else DecodeGraphs(self.inputs, self.sizes, capture=False)

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
        return self.decode is not None

    # ---- per step -------------------------------------------------------------------------

    def prepare(self, common: CommonAttentionMetadata) -> int | None:
        """Pad the one-token step `common` into the graph buffers (host work and copies only);
        the size to replay, or None when it runs eagerly (then nothing was written)."""
        return None if self.decode is None else self.decode.prepare([common])

    def replay(self, size: int, ids: torch.Tensor, hidden: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prepared step over `ids` [n] (and a head's `hidden` inputs [n, H]): its hidden
        states [n, H] and greedy ids [n] of the draft's own vocabulary (None without the head
        graphs). Both are views of the graph's outputs, rewritten by the next replay: read
        them in work queued before it."""
        assert self.decode is not None
        n = len(ids)
        self.ids.device[:n].copy_(ids)
        if self.hidden is not None:
            self.hidden[:n].copy_(hidden)
        out = self.decode.replay(size, n)
        return out, self.decode.greedy_tokens(n)

    @property
    def replays(self) -> int:
        return 0 if self.decode is None else sum(self.decode.replays.values())


def make_draft_graphs(runner: Any, module: torch.nn.Module, forward: DraftForward,
                      logits: Callable[[torch.Tensor], torch.Tensor],
                      hidden_size: int | None = None, capture: bool = True,
                      positions: GraphPositions | None = None) -> DraftGraphs | None:
    """The proposer's draft graphs, or None where its steps run eagerly: on the CPU (unless
    `capture` is off, for tests), with --enforce-eager, a backend without graphs, or a failed
    capture or check (logged)."""
    graphs = DraftGraphs(runner, module, forward, logits, hidden_size, capture, positions)
    if not capture:
        return graphs
    if not graphs.capture():
        logger.info("draft steps run eagerly (no CUDA graphs)")
        return None
    logger.info("draft steps replay CUDA graphs of %s rows", graphs.sizes)
    return graphs
