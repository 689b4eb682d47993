"""EAGLE-1 and EAGLE-3 heads, and DeepSeek's multi-token-prediction layer, as proposers (the
heads: `eagle_head.py`, `mtp_head.py`).

A head at position i reads the target's hidden state at i and the token at i + 1, and
predicts the token at i + 2; its attention layer keeps K/V of its own, which joins the
target's cache as a draft model's does (its layer numbered after the target's, its own cache
tensors at the same block ids). Since a position's K/V needs the token after it, the head
runs only once a step's samples are back: over each request's positions of the step whose
next token is verified (a verify step's kept ones; every position of a prompt chunk), with
the target's hidden states captured during the step's forward; the last of those gives the
first draft. Then K - 1 one-token steps, each from the draft before it and the head's own
hidden state, at positions up to K - 2 past the newest token (the scheduler reserves K
lookahead slots). A rejected draft's head K/V is rewritten by the next step's pass, as the
target's is. A prefix-cache hit brings the head's K/V of the hit blocks; the last hit
position's was computed from the cached sequence's next token, which may differ: only the
drafts can change (acceptance), never the output. On CUDA the K - 1 one-token steps replay
graphs per padded row count (draft_graphs.py); the catch-up pass, of any shape, runs eagerly.

A head whose rotary is M-RoPE (`EagleHead.uses_mrope`, over Qwen2.5-VL / Qwen3-VL) turns by
the positions the target gives the same tokens: the catch-up pass's [3, T] from each
request's prompt rows (`mrope_positions`) and past its prompt index + `mrope_delta` on every
row, the one-token steps (always past the prompt) by index + delta, in a buffer of the
proposer's own that the draft graphs read. A head without M-RoPE turns by the token index, as
over a text target.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedserve.attention.forward_context import set_forward_context
from pagedserve.attention.layer import Attention
from pagedserve.device import array_to_device, arrays_to_device
from pagedserve.multimodal.mrope import MRopeStepPositions
from pagedserve.spec_decode.draft_graphs import DraftGraphs, make_draft_graphs
from pagedserve.spec_decode.eagle_head import load_head
from pagedserve.spec_decode.mtp_head import load_mtp_head
from pagedserve.spec_decode.proposer import Drafts, Proposer, StepTokens


class EagleProposer(Proposer):
    uses_kv_cache = True

    def __init__(self, num_speculative_tokens: int, method: str, model: str | None,
                 target: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 max_model_len: int) -> None:
        super().__init__(num_speculative_tokens)
        decoder = getattr(target, "model", None)
        # An MTP layer reads the final hidden state only; EAGLE heads tap layers.
        if not hasattr(decoder, "embed_tokens") or (method != "mtp"
                                                    and not hasattr(decoder, "tap_layers")):
            raise ValueError(f"speculative_config: method {method!r} needs a Llama-style "
                             f"target whose hidden states it can tap; "
                             f"{type(target).__name__} exposes none")
        if method == "mtp":  # `model`: the target's checkpoint, which holds the layer
            self.head = load_mtp_head(model, target, dtype, device)
        else:
            self.head = load_head(method, model, target, dtype, device)
        if self.head.reads == "taps":
            decoder.tap_layers = self.head.tap_layers
        self.decoder = decoder
        self.device = device
        self.max_model_len = max_model_len
        self.graphs: DraftGraphs | None = None  # its one-token steps' CUDA graphs
        self.mrope: MRopeStepPositions | None = None  # an M-RoPE head's positions (lazily)
        self._tokens: torch.Tensor | None = None  # a proposal's drafts, column by column

    def setup_graphs(self, runner: Any, capture: bool = True) -> None:
        positions = None
        if self.head.uses_mrope:  # the graphs read the M-RoPE buffer's first columns
            buffer = self._mrope(runner)
            positions = lambda flat: buffer.device[:, :flat.shape[0]]  # noqa: E731
        # (an M-RoPE head's catch-up turns by positions the graphs' buffer does not hold)
        self.graphs = make_draft_graphs(runner, self.head, self.head, self.head.logits,
                                        self.head.hidden_size, capture, positions,
                                        catch_up=not self.head.uses_mrope)

    def _mrope(self, runner: Any) -> MRopeStepPositions:
        if self.mrope is None:  # a step's tokens (catch-up pass) or rows (one-token steps)
            self.mrope = MRopeStepPositions(max(runner.max_num_tokens, runner.max_num_reqs),
                                            self.device)
        return self.mrope

    def attention_layers(self, first_index: int) -> list[Attention]:
        attn = self.head.layer.self_attn.attn
        attn.layer_idx = first_index
        return [attn]

    def forward_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     hidden: torch.Tensor) -> torch.Tensor:
        """The step's hidden states the head reads: the tapped layers' inputs side by side
        (EAGLE-3), or the target's final hidden states (EAGLE-1)."""
        if self.head.reads == "taps":
            return torch.cat([self.decoder.tapped[i] for i in self.head.tap_layers], dim=-1)
        return hidden

    @torch.inference_mode()
    def propose_from(self, runner: Any, step: StepTokens) -> Drafts:
        """The head's pass over the step's verified positions (its K/V, the first drafts),
        then K - 1 one-token steps for the eligible rows, within their blocks."""
        b = len(step.rows)
        drafts = Drafts(np.zeros((b, self.k), dtype=np.int64), np.zeros(b, dtype=np.int32))
        inputs_copied = getattr(runner, "_inputs_copied", None)
        if inputs_copied is not None:  # the launched step's copies read the same buffers
            inputs_copied.synchronize()
        copied = torch.cuda.Event() if self.device.type == "cuda" else None
        live, hidden, token = self._catch_up(runner, step, copied)
        if live is None:
            return drafts
        table = runner.input_batch.block_table
        start = step.num_tokens.astype(np.int64) - 1  # the newest token's position
        capacity = np.minimum(table.num_blocks[step.rows].astype(np.int64) * runner.block_size,
                              runner.max_model_len)
        limit = np.zeros(b, dtype=np.int64)
        limit[live] = np.where(step.eligible[live], np.clip(capacity[live] - start[live], 0,
                                                            self.k), 0)
        act = np.flatnonzero(limit[live] > 0)  # indices into live
        if act.size < live.size:  # (most steps: every row drafts, no gather needed)
            act_dev = array_to_device(act, self.device)
            token, hidden = token[act_dev], hidden[act_dev]
        rows = live[act]
        # Each draft step's tokens, for `rows` then, go into a slice of one device buffer
        # (a graph's outputs are rewritten by its next replay), copied to the host at the end
        # and placed there: no index lists uploaded, nothing scattered on the device.
        if self._tokens is None or self._tokens.shape[0] < b * self.k:
            self._tokens = torch.empty(max(runner.max_num_reqs, b) * self.k,
                                       dtype=torch.int64, device=self.device)
        columns = [rows]
        self._tokens[:rows.size].copy_(token)
        filled = rows.size
        deltas = (np.fromiter((r.mrope_delta for r in step.requests), np.int64, b)
                  if self.head.uses_mrope else None)
        for j in range(1, self.k):
            keep = np.flatnonzero(limit[rows] > j)
            if not keep.size:
                break
            if keep.size < rows.size:
                keep_dev = array_to_device(keep, self.device)
                rows, token, hidden = rows[keep], token[keep_dev], hidden[keep_dev]
            if copied is not None:
                copied.synchronize()
            n = len(rows)
            common = runner.common_builder.build(
                step.rows[rows], (start[rows] + j - 1).astype(np.int32),
                np.ones(n, dtype=np.int32), 0, table.table)
            turn_by = (None if deltas is None else  # past the prompt: index + delta, all rows
                       self._mrope(runner).build_past_prompts(start[rows] + j - 1, deltas[rows]))
            hidden, token = self._step(runner, common, token, hidden, copied, turn_by)
            self._tokens[filled:filled + n].copy_(token)
            columns.append(rows)
            filled += n
        host = self._tokens[:filled].to("cpu", non_blocking=True)  # pinned on CUDA
        done = torch.cuda.Event() if copied is not None else None
        if done is not None:
            done.record()

        def place() -> None:  # once the scheduler reads them (after the step's samples)
            if done is not None:
                done.synchronize()
            flat = host.numpy()
            at = 0
            for j, rows_j in enumerate(columns):
                drafts.token_ids[rows_j, j] = flat[at:at + rows_j.size]
                at += rows_j.size

        if done is None:
            place()  # (the CPU's copy is done already)
        else:
            drafts.pending = place
        drafts.counts = limit.astype(np.int32)
        return drafts

    def _catch_up(self, runner: Any, step: StepTokens, copied: torch.cuda.Event | None
                  ) -> tuple[np.ndarray | None, torch.Tensor, torch.Tensor]:
        """The head over each current row's positions of the step whose next token is known:
        its K/V there. Returns the rows run (prompt chunks first, as batches are ordered),
        the head's hidden state at each one's last position and the draft it gives."""
        c = step.num_computed.astype(np.int64)
        s = step.num_scheduled.astype(np.int64)
        m = np.where(step.will_sample, np.minimum(s, step.num_tokens - 1 - c), s)
        m = np.minimum(m, self.max_model_len - 1 - c)  # the next token must be in the table
        m = np.where(step.current, np.maximum(m, 0), 0)
        live = np.flatnonzero(m > 0)
        if not live.size:
            return None, torch.empty(0), torch.empty(0)
        if live.size == len(m) and (s == self.k + 1).all():
            uniform = self._catch_up_uniform(runner, step, c, m, copied)
            if uniform is not None:
                return uniform
        live = live[np.argsort(m[live] == 1, kind="stable")]
        num_prefills = int((m[live] > 1).sum())
        ml = m[live]
        first_hidden = np.cumsum(s) - s  # each row's first captured hidden state
        req = np.repeat(np.arange(len(live)), ml)
        within = np.arange(int(ml.sum())) - np.repeat(np.cumsum(ml) - ml, ml)
        positions = c[live][req] + within
        ids = runner.input_batch.token_ids[step.rows[live][req], positions + 1]
        # One copy for the step's index arrays (each copy costs the host a launch).
        rows_hidden, ids_dev, last = arrays_to_device(
            [first_hidden[live][req] + within, ids, np.cumsum(ml) - 1], self.device)
        common = runner.common_builder.build(step.rows[live], c[live].astype(np.int32),
                                             ml.astype(np.int32), num_prefills,
                                             runner.input_batch.block_table.table)
        turn_by = None  # the metadata keeps its [T] positions; an M-RoPE head turns by these
        if self.head.uses_mrope:  # the target's rows for these tokens
            turn_by = self._mrope(runner).build([step.requests[i] for i in live], c[live], ml,
                                                np.cumsum(ml) - ml, positions)
        hidden = self.head.combine(step.captured[rows_hidden])
        out = self._run(runner, common, ids_dev, hidden, copied, turn_by)
        out = out[last]
        return live, out, self.head.draft_ids(out)

    def _catch_up_uniform(self, runner: Any, step: StepTokens, c: np.ndarray, m: np.ndarray,
                          copied: torch.cuda.Event | None
                          ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor] | None:
        """The catch-up pass of a uniform verify step (every row current, 1+K tokens) from
        the catch-up graphs, over all 1+K positions of each row, its kept ones and those past
        them: None where it has no graph. The real rows read only the positions before theirs,
        as the eager pass's do, so their hidden states are the same; the K/V written past a
        row's newest token is rewritten before it is read (by the draft steps, or the next
        step's pass, from that position on)."""
        graphs = self.graphs
        if graphs is None or not graphs.catches_up:
            return None
        b, q = len(m), self.k + 1
        table = runner.input_batch.block_table.table
        common = runner.common_builder.build(step.rows, c.astype(np.int32),
                                             np.full(b, q, dtype=np.int32), b, table)
        size = graphs.prepare(common)
        if size is None:
            return None
        # Each position's next token (the last position's is past the verified ones: any
        # id within the table).
        ahead = np.minimum(c[:, None] + np.arange(1, q + 1), self.max_model_len - 1)
        ids = runner.input_batch.token_ids[step.rows[:, None], ahead]
        ids_dev, last = arrays_to_device([ids, np.arange(b) * q + m - 1], self.device)
        hidden = self.head.combine(step.captured[:b * q])
        if copied is not None:
            copied.record()
        out, _ = graphs.replay(size, ids_dev.view(-1), hidden, num_reqs=b)
        out = out[last]
        return np.arange(b), out, self.head.draft_ids(out)

    def _step(self, runner: Any, common: Any, ids: torch.Tensor, hidden: torch.Tensor,
              copied: torch.cuda.Event | None, turn_by: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: the head's hidden states and draft ids, from the step's graph when
        it has one (the graph's greedy ids are of the head's vocabulary; an M-RoPE head's
        graph reads `turn_by`'s buffer)."""
        size = self.graphs.prepare(common) if self.graphs is not None else None
        if size is None:
            hidden = self._run(runner, common, ids, hidden, copied, turn_by)
            return hidden, self.head.draft_ids(hidden)
        if copied is not None:
            copied.record()
        hidden, greedy = self.graphs.replay(size, ids, hidden)
        return hidden, (self.head.draft_ids(hidden) if greedy is None
                        else self.head.target_ids(greedy))

    def _run(self, runner: Any, common: Any, ids: torch.Tensor, hidden: torch.Tensor,
             copied: torch.cuda.Event | None, turn_by: torch.Tensor | None = None
             ) -> torch.Tensor:
        """The head eagerly at `common`'s tokens, turned by `turn_by` (an M-RoPE head's
        [3, T]) or the metadata's positions."""
        metadata = {key: builder.build(common) for key, builder in runner.builders.items()}
        if copied is not None:
            copied.record()
        with set_forward_context(metadata, runner.kv_caches):
            return self.head(ids, common.positions if turn_by is None else turn_by, hidden)
