"""Output processing: the core's compact step outputs become RequestOutputs (text, logprobs,
scores).

This is the front's side of a step. Per sequence it keeps the detokenizer (which also finds stop
strings), the token ids, logprobs and scores received so far, and what has been sent; per
request it fans the `n` sequences back into one output. It touches no scheduler or runner
state: it returns the sequences a stop string ended (the front has the core finish them) and
the ones it reported finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedserve.engine.core_messages import StepOutput
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagedserve.pooling.outputs import pooling_output
from pagedserve.sampling_params import SamplingParams


@dataclass
class SequenceState:
    """The front's state of one sequence (one of a request's `n` samples)."""

    seq_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""  # streamed so far
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    num_preemptions: int = 0
    # Scoring (teacher-forced or by prefill): chunks [rows, V] of next-token log-distributions.
    forced_logprobs: list[Any] | None = None
    embedding: Any = None  # a pooling sequence's, float32 [dimensions] (pooling/)


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    finished_seqs: set[int] = field(default_factory=set)
    # False: only the final RequestOutput is made (offline generation needs no per-step ones).
    stream: bool = True

    @property
    def finished(self) -> bool:
        return len(self.finished_seqs) == len(self.sequences)


@dataclass
class ProcessedStep:
    outputs: list[RequestOutput]
    finished: list[str]  # sequences reported finished
    stopped: list[str]  # sequences a stop string ended: the core must finish them


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.seq_of: dict[str, tuple[RequestState, SequenceState]] = {}

    def add(self, state: RequestState) -> None:
        self.states[state.request_id] = state
        for seq in state.sequences:
            self.seq_of[seq.seq_id] = (state, seq)

    def new_sequence(self, seq_id: str, index: int, prompt_token_ids: list[int],
                     params: SamplingParams, scoring: bool = False) -> SequenceState:
        detok = None
        if self.tokenizer is not None and not scoring and params.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        wants_lp = params.logprobs is not None and not scoring
        seq = SequenceState(seq_id, index, params, detok, [] if wants_lp else None,
                            0.0 if wants_lp else None)
        if scoring:
            seq.forced_logprobs = []
        return seq

    def remove(self, request_id: str) -> RequestState | None:
        state = self.states.pop(request_id, None)
        if state is not None:
            for seq in state.sequences:
                self.seq_of.pop(seq.seq_id, None)
        return state

    def fail(self, seq_id: str) -> RequestOutput | None:
        """The core could not add a sequence: its request ends, aborted."""
        entry = self.seq_of.get(seq_id)
        if entry is None:
            return None
        state, _ = entry
        for seq in state.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        return self._make_output(state, state.metrics.last_token_time or 0.0, [])

    def process(self, step: StepOutput) -> ProcessedStep:
        """Record a completed step's tokens. A sequence a stop string ended is finished here
        (the caller has the core free it), so its output carries its finish reason; tokens the
        core sent for a sequence already finished here are dropped."""
        now = step.time
        seq_of = self.seq_of
        for seq_id, (first_time, num_cached) in step.scheduled.items():
            entry = seq_of.get(seq_id)
            if entry is not None and entry[0].metrics.first_scheduled_time is None:
                entry[0].metrics.first_scheduled_time = first_time
                entry[0].num_cached_tokens = num_cached
        for seq_id, n in step.num_preemptions.items():
            if seq_id in seq_of:
                seq_of[seq_id][1].num_preemptions = n
        touched: dict[str, RequestState] = {}
        may_finish: set[str] = set()  # states one of whose sequences may have just ended
        stopped: list[str] = []
        extras = bool(step.prompt_logprobs or step.scores or step.logprobs is not None
                      or step.embeddings)
        tokens = step.tokens.tolist() if step.tokens is not None else []
        for row, (seq_id, token) in enumerate(zip(step.seq_ids, tokens, strict=True)):
            entry = seq_of.get(seq_id)
            if entry is None:
                continue
            state, seq = entry
            if seq.finish_reason is not None:
                continue  # a stop string ended it; the core has not heard yet
            if extras:
                self._record_extras(step, row, seq_id, token, state, seq)
            if token < 0:
                continue
            touched[state.request_id] = state
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            seq.token_ids.append(token)
            end = step.finished.get(seq_id)
            if end is not None and row + 1 < len(tokens) and step.seq_ids[row + 1] == seq_id:
                end = None  # a verify step's tokens: the finish is its last one's
            if end is not None:
                seq.finish_reason, seq.stop_reason, on_end_token = end
                if on_end_token:
                    # EOS and stop token ids end the sequence without adding their text.
                    may_finish.add(state.request_id)
                    continue
            if seq.detokenizer is not None and not seq.detokenizer.finished:
                stop = seq.detokenizer.update([token])
                if stop is not None:
                    # A stop string; also when the length limit was met on the same token.
                    seq.stop_reason = stop
                    cut = seq.detokenizer.num_cut_tokens
                    if cut and seq.logprobs is not None:
                        # Logprobs are for the tokens whose text is returned.
                        del seq.logprobs[-cut:]
                    if seq.finish_reason is None:
                        stopped.append(seq_id)
                    seq.finish_reason = "stop"
            if seq.finish_reason is not None:
                may_finish.add(state.request_id)
        finished: list[str] = []
        outputs = [self._make_output(state, now, finished) for state in touched.values()
                   if state.stream or (state.request_id in may_finish
                                       and _has_new_finish(state))]
        return ProcessedStep(outputs, finished, stopped)

    def _record_extras(self, step: StepOutput, row: int, seq_id: str, token: int,
                       state: RequestState, seq: SequenceState) -> None:
        """Prompt logprobs, scores and a sampled token's logprobs of one sequence."""
        chunk = step.prompt_logprobs.get(seq_id)
        if chunk is not None and state.prompt_logprobs is not None:
            # This chunk predicted prompt positions first..; a request recomputing its prompt
            # after preemption already has the first of them.
            first, values, ids, ranks = chunk
            positions = self._positions(values, ids, ranks, seq.params.detokenize)
            state.prompt_logprobs.extend(positions[len(state.prompt_logprobs) - first:])
        if seq_id in step.embeddings:
            seq.embedding = step.embeddings[seq_id]
        rows = step.scores.get(seq_id)
        if rows is not None and seq.forced_logprobs is not None:
            seq.forced_logprobs.append(torch.from_numpy(np.array(rows, np.float32)))
        if token >= 0 and seq.logprobs is not None and step.logprobs is not None:
            k = seq.params.logprobs + 1
            values, ids, ranks = step.logprobs
            position = self._positions(values[row:row + 1, :k], ids[row:row + 1, :k],
                                       ranks[row:row + 1], seq.params.detokenize)[0]
            seq.logprobs.append(position)
            seq.cumulative_logprob += position[token].logprob

    def _positions(self, values: Any, ids: Any, ranks: Any, decode: bool = True
                   ) -> list[PositionLogprobs]:
        """Logprob rows -> per-position dicts {token id: Logprob}; column 0 is the chosen token
        (its rank computed), the rest the top alternatives ranked 1..K. `decode`: with each
        token's text."""
        out = []
        for row_ids, row_values, rank in zip(ids.tolist(), values.tolist(), ranks.tolist(),
                                             strict=True):
            position: PositionLogprobs = {}
            for j, (tid, value) in enumerate(zip(row_ids, row_values, strict=True)):
                if tid in position:
                    continue
                position[tid] = Logprob(value, rank if j == 0 else j,
                                        self._token_text(tid) if decode else None)
            out.append(position)
        return out

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _make_output(self, state: RequestState, now: float,
                     finished: list[str]) -> RequestOutput:
        completions = []
        pooled = state.sequences[0].embedding is not None  # its output is the embedding alone
        for seq in state.sequences:
            finish_reason = seq.finish_reason
            if finish_reason is not None and seq.index not in state.finished_seqs:
                state.finished_seqs.add(seq.index)
                self.seq_of.pop(seq.seq_id, None)
                finished.append(seq.seq_id)
            if pooled:
                continue
            delta = ""
            sent_to = len(seq.token_ids)
            if seq.detokenizer is not None:
                delta = seq.detokenizer.get_next_delta(finished=finish_reason is not None)
                seq.text += delta
                if finish_reason is None:
                    # Tokens whose text is held back (it may yet turn out to be a stop
                    # string's) wait with it, their logprobs too.
                    sent_to = max(seq.num_sent_tokens,
                                  min(sent_to, seq.detokenizer.num_settled_tokens))
            new_ids = seq.token_ids[seq.num_sent_tokens:sent_to]
            seq.num_sent_tokens = sent_to
            delta_lp = None
            if seq.logprobs is not None:
                # Finished: all of them (a stop string's tokens were dropped already).
                lp_to = len(seq.logprobs) if finish_reason is not None else sent_to
                delta_lp = seq.logprobs[seq.num_sent_logprobs:lp_to]
                seq.num_sent_logprobs = max(seq.num_sent_logprobs, lp_to)
            completions.append(CompletionOutput(
                index=seq.index, text=seq.text, token_ids=list(seq.token_ids),
                cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs,
                finish_reason=finish_reason, stop_reason=seq.stop_reason, delta_text=delta,
                delta_token_ids=new_ids, delta_logprobs=delta_lp,
                forced_logprobs=_concat(seq.forced_logprobs) if finish_reason else None))
        state.metrics.num_preemptions = sum(s.num_preemptions for s in state.sequences)
        if state.finished:
            state.metrics.finished_time = now
            self.states.pop(state.request_id, None)
        if pooled:
            return pooling_output(state.request_id, state.prompt, state.prompt_token_ids,
                                  state.sequences[0].embedding, state.metrics)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                             state.prompt_logprobs, completions, state.finished, state.metrics,
                             state.num_cached_tokens)


def _has_new_finish(state: RequestState) -> bool:
    return any(seq.finish_reason is not None and seq.index not in state.finished_seqs
               for seq in state.sequences)


def _concat(chunks: list[Any] | None) -> Any:
    if not chunks:
        return None
    return torch.cat(chunks)
