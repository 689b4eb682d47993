"""A draft model: any supported model with the target's vocabulary proposes K tokens, greedily
(a draft that is a function of its context has one-hot probabilities, which the rejection
sampler assumes when it is given none: the output stays exactly the target's).

Its attention layers join the target's KV cache: numbered after the target's layers, they get
cache tensors of their own at the same block ids, so a request's blocks hold both models' K/V
for its positions (one block table, one pool; sizing counts both; a prefix-cache hit brings
both). The draft runs over every step's tokens right after the target (its K/V for them), then
after the samples are back, K one-token steps from each request's newest token, which write
up to K - 1 positions past the next verify step's first: the scheduler reserves K lookahead
slots per request for them. A rejected draft's K/V is rewritten by the next step, as the
target's is. On CUDA the K steps replay graphs per padded row count (draft_graphs.py).
A vision-language draft model is refused: it would be given no images (nor M-RoPE rows).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from pagedserve.attention.forward_context import set_forward_context
from pagedserve.attention.layer import Attention
from pagedserve.attention.state import StateLayer
from pagedserve.device import array_to_device
from pagedserve.distributed.parallel_state import single_rank
from pagedserve.spec_decode.draft_graphs import DraftGraphs, make_draft_graphs
from pagedserve.spec_decode.proposer import Drafts, Proposer, StepTokens


class DraftModelProposer(Proposer):
    uses_kv_cache = True

    def __init__(self, num_speculative_tokens: int, model: str, dtype: torch.dtype,
                 device: torch.device, max_model_len: int, vocab_size: int,
                 whole: bool = False) -> None:
        """`whole`: under tensor parallelism, the whole draft on every rank
        (`draft_tensor_parallel_size` 1): built and loaded as one rank's, its forwards run no
        collectives, and every rank computes the same drafts."""
        from pagedserve.models.loader import load_model

        super().__init__(num_speculative_tokens)
        try:
            with single_rank() if whole else nullcontext():
                loaded = load_model(model, dtype, device, max_model_len,
                                    generation_config="vllm")
        except ValueError as exc:  # e.g. a shorter context than the target's
            draft_vocab = _config_vocab_size(model)
            if draft_vocab is not None and draft_vocab != vocab_size:
                # The vocabulary rules the draft out whatever the context: say that first.
                raise _vocab_error(model, draft_vocab, vocab_size) from None
            hint = ""
            if str(exc).startswith(f"max_model_len {max_model_len} is larger"):
                limit = str(exc).rpartition(" ")[2]
                hint = (f": a draft covers the target's whole context, so serve the target "
                        f"with --max-model-len {limit} or less")
            raise ValueError(f"speculative_config: the draft model {model!r}: {exc}{hint}"
                             ) from None
        if getattr(loaded.model, "supports_multimodal", False):
            # Its steps would embed the image placeholders' ids, never its own tower's rows,
            # and turn by [T] positions where it places tokens by M-RoPE.
            raise ValueError(f"speculative_config: the draft model {model!r} "
                             f"({type(loaded.model).__name__}) takes images, which a draft model "
                             "is not given; use a text model with the target's vocabulary or "
                             "an EAGLE head")
        draft_vocab = loaded.hf_config.vocab_size
        if draft_vocab != vocab_size:
            raise _vocab_error(model, draft_vocab, vocab_size)
        self.model = loaded.model
        if any(isinstance(m, StateLayer) for m in self.model.modules()):
            raise ValueError(f"speculative_config: the draft model {model!r} has state layers, "
                             "whose state cannot be rolled back past rejected drafts")
        self.device = device
        self.graphs: DraftGraphs | None = None  # its steps' CUDA graphs (setup_graphs)

    def setup_graphs(self, runner: Any, capture: bool = True) -> None:
        self.graphs = make_draft_graphs(runner, self.model,
                                        lambda ids, positions, _: self.model(ids, positions),
                                        self.model.compute_logits, capture=capture)

    def attention_layers(self, first_index: int) -> list[Attention]:
        """The draft's attention layers, renumbered to follow the target's `first_index`
        layers (their index is their cache's)."""
        layers = sorted((m for m in self.model.modules() if isinstance(m, Attention)),
                        key=lambda m: m.layer_idx)
        for i, layer in enumerate(layers):
            layer.layer_idx = first_index + i
        return layers

    def forward_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     hidden: torch.Tensor) -> None:
        """The draft over a step's tokens, under the step's forward context: its K/V."""
        self.model(input_ids, positions)

    @torch.inference_mode()
    def propose_from(self, runner: Any, step: StepTokens) -> Drafts:
        """K greedy one-token steps of the draft from each eligible row's newest token
        (at position num_tokens - 1), on the runner's block table and caches."""
        rows, num_tokens, eligible, newest = (step.rows, step.num_tokens, step.eligible,
                                              step.newest)
        b = len(rows)
        drafts = Drafts(np.zeros((b, self.k), dtype=np.int64), np.zeros(b, dtype=np.int32))
        table = runner.input_batch.block_table
        # Positions past a row's blocks have no slot (nor past the context): drafts stop there.
        capacity = np.minimum(table.num_blocks[rows].astype(np.int64) * runner.block_size,
                              runner.max_model_len)
        start = num_tokens.astype(np.int64) - 1
        limit = np.where(eligible, np.clip(capacity - start, 0, self.k), 0)
        ids = array_to_device(newest.astype(np.int64), self.device)
        out = torch.zeros(b, self.k, dtype=torch.int64, device=self.device)
        # Each step's metadata goes through the runner's pinned buffers: the next step rewrites
        # them only once the copies queued from them have run.
        copied = torch.cuda.Event() if self.device.type == "cuda" else None
        inputs_copied = getattr(runner, "_inputs_copied", None)
        if inputs_copied is not None:  # the launched step's copies read the same buffers
            inputs_copied.synchronize()
        for j in range(self.k):
            live = np.flatnonzero(limit > j)
            if not live.size:
                break
            if copied is not None and j:
                copied.synchronize()
            live_dev = array_to_device(live, self.device)
            common = runner.common_builder.build(
                rows[live], (start[live] + j).astype(np.int32), np.ones(len(live), np.int32),
                0, table.table)
            token = self._step(runner, common, ids[live_dev], copied)
            out[live_dev, j] = token
            ids = ids.clone()
            ids[live_dev] = token
        drafts.token_ids = out.cpu().numpy()  # (waits for the steps: the buffers are free)
        drafts.counts = limit.astype(np.int32)
        return drafts

    def _step(self, runner: Any, common: Any, ids: torch.Tensor,
              copied: torch.cuda.Event | None) -> torch.Tensor:
        """One draft step over `ids` at `common`'s positions: its greedy ids, from the step's
        graph when it has one. `copied` is recorded once the step's copies are queued."""
        size = self.graphs.prepare(common) if self.graphs is not None else None
        metadata = (None if size is not None else
                    {key: builder.build(common) for key, builder in runner.builders.items()})
        if copied is not None:
            copied.record()
        if size is not None:
            hidden, token = self.graphs.replay(size, ids)
            return token if token is not None else self.model.compute_logits(hidden).argmax(-1)
        with set_forward_context(metadata, runner.kv_caches):
            hidden = self.model(ids, common.positions)
        return self.model.compute_logits(hidden[:len(ids)]).argmax(dim=-1)


def _vocab_error(model: str, draft_vocab: int, vocab_size: int) -> ValueError:
    return ValueError(f"speculative_config: the draft model {model!r} has a vocabulary of "
                      f"{draft_vocab} tokens, the target {vocab_size}: a draft must share the "
                      "target's vocabulary")


def _config_vocab_size(model: str) -> int | None:
    """The draft's vocabulary size from its config alone (None where it cannot be read)."""
    from pagedserve.models import gguf_file
    from pagedserve.models.loader import model_path, text_config_of

    try:
        path = model_path(model)
        if path.is_dir():
            from transformers import AutoConfig

            config = text_config_of(AutoConfig.from_pretrained(path))
        else:
            config = gguf_file.gguf_config(gguf_file.open_gguf(str(path)))
        return int(config.vocab_size)
    except Exception:  # the load's own error is the one to report then
        return None
