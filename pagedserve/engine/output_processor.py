"""Output processing: a step's tokens become RequestOutputs (text, logprobs, scores).

The engine's step path ends here. Per sequence it keeps the detokenizer (which also finds stop
strings), the logprobs and scores received so far, and what has been sent; per request it fans
the `n` sequences back into one output. It touches no scheduler or runner state: it returns the
sequences a stop string ended and the ones it reported finished, and the engine acts on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagedserve.engine.sampler import LogprobsTensors
from pagedserve.scheduler import Request, RequestStatus, SchedulerOutput

if TYPE_CHECKING:
    from pagedserve.engine.model_runner import ModelRunnerOutput


@dataclass
class SequenceState:
    """Engine-side state of one sequence (one of a request's `n` samples)."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    text: str = ""  # streamed so far
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    # Scoring (teacher-forced or by prefill): chunks [rows, V] of next-token log-distributions.
    forced_logprobs: list[Any] | None = None
    num_scored: int = 0  # rows in forced_logprobs


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
    finished: list[str]  # sequences reported finished: the engine forgets them
    num_tokens: int  # new output tokens


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.seq_of: dict[str, tuple[RequestState, SequenceState]] = {}

    def add(self, state: RequestState) -> None:
        self.states[state.request_id] = state
        for seq in state.sequences:
            self.seq_of[seq.request.request_id] = (state, seq)

    def new_sequence(self, request: Request, index: int) -> SequenceState:
        params = request.sampling_params
        detok = None
        if self.tokenizer is not None and request.scoring is None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)
        wants_lp = params.logprobs is not None
        seq = SequenceState(request, index, detok, [] if wants_lp else None,
                            0.0 if wants_lp else None)
        if request.scoring is not None:
            seq.forced_logprobs = []
        return seq

    def remove(self, request_id: str) -> RequestState | None:
        state = self.states.pop(request_id, None)
        if state is not None:
            for seq in state.sequences:
                self.seq_of.pop(seq.request.request_id, None)
        return state

    def process(self, batch: SchedulerOutput, output: ModelRunnerOutput,
                results: list[tuple[Request, int | None]], now: float,
                finish_stopped: Callable[[list[str]], object]) -> ProcessedStep:
        """Record a completed step's tokens (`results`, from the scheduler). Sequences a stop
        string ended go to `finish_stopped` (the scheduler frees them) before the outputs are
        made, so those carry their finish reason."""
        touched: dict[str, RequestState] = {}
        may_finish: set[str] = set()  # states one of whose sequences may have just ended
        # Logprobs, prompt logprobs, scores and teacher forcing are rare: the loop below
        # looks at them only when the step produced any.
        extras = bool(output.prompt_logprobs or output.score_logprobs
                      or output.forced_logprobs or output.logprobs is not None)
        # Batch rows, needed only to find logprobs (results skip finished requests).
        row_of = ({r.request_id: i for i, r in enumerate(batch.requests)}
                  if output.prompt_logprobs or output.logprobs is not None else {})
        stopped: list[str] = []
        num_tokens = 0
        for request, token in results:
            state, seq = self.seq_of[request.request_id]
            if extras:
                self._record_prompt_extras(batch, output, row_of, request, state, seq)
            if token is None:
                continue
            if extras:
                self._record_token_extras(output, row_of, request, token, seq)
            touched[state.request_id] = state
            num_tokens += 1
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            if request.status == RequestStatus.FINISHED_STOPPED:
                # EOS and stop token ids end the sequence without adding their text; a stop
                # token id is its stop reason, EOS none.
                if token in request.sampling_params.stop_token_ids:
                    seq.stop_reason = token
            elif seq.detokenizer is not None and not seq.detokenizer.finished:
                stop = seq.detokenizer.update([token])
                if stop is not None:
                    seq.stop_reason = stop
                    if not request.is_finished:
                        stopped.append(request.request_id)
                    else:  # the length limit and a stop string met on the same token
                        request.status = RequestStatus.FINISHED_STOPPED
            if request.is_finished or seq.stop_reason is not None:
                may_finish.add(state.request_id)
        if stopped:
            finish_stopped(stopped)
        finished: list[str] = []
        outputs = [self._make_output(state, now, finished) for state in touched.values()
                   if state.stream or (state.request_id in may_finish
                                       and _has_new_finish(state))]
        return ProcessedStep(outputs, finished, num_tokens)

    def _record_prompt_extras(self, batch: SchedulerOutput, output: ModelRunnerOutput,
                              row_of: dict[str, int], request: Request, state: RequestState,
                              seq: SequenceState) -> None:
        """Prompt logprobs and prefill scores a step computed for a request."""
        if request.request_id in output.prompt_logprobs and state.prompt_logprobs is not None:
            # This chunk predicted prompt positions computed+1..; a request recomputing its
            # prompt after preemption already has the first of them.
            first = int(batch.num_computed_tokens[row_of[request.request_id]]) + 1
            positions = self._positions(output.prompt_logprobs[request.request_id])
            state.prompt_logprobs.extend(positions[len(state.prompt_logprobs) - first:])
        if request.request_id in output.score_logprobs and seq.forced_logprobs is not None:
            # Rows by position: a request recomputing its prompt after preemption sends
            # positions it already sent.
            first, rows = output.score_logprobs[request.request_id]
            skip = request.score_from + seq.num_scored - first
            assert skip >= 0, "a gap in the scored positions"
            if skip < rows.shape[0]:
                seq.forced_logprobs.append(rows[skip:])
                seq.num_scored += rows.shape[0] - skip

    def _record_token_extras(self, output: ModelRunnerOutput, row_of: dict[str, int],
                             request: Request, token: int, seq: SequenceState) -> None:
        """A teacher-forced token's distribution and a sampled token's logprobs."""
        if request.forced_output_ids is not None and seq.forced_logprobs is not None:
            seq.forced_logprobs.append(output.forced_logprobs[request.request_id][None])
            seq.num_scored += 1
        if seq.logprobs is not None and output.logprobs is not None:
            row = row_of[request.request_id]
            k = request.sampling_params.logprobs
            lp = LogprobsTensors(output.logprobs.logprobs[row:row + 1, :k + 1],
                                 output.logprobs.token_ids[row:row + 1, :k + 1],
                                 output.logprobs.ranks[row:row + 1])
            position = self._positions(lp)[0]
            seq.logprobs.append(position)
            seq.cumulative_logprob += position[token].logprob

    def _positions(self, lp: LogprobsTensors) -> list[PositionLogprobs]:
        """LogprobsTensors rows -> per-position dicts {token id: Logprob}; column 0 is the
        chosen token (its rank computed), the rest the top alternatives ranked 1..K."""
        ids = lp.token_ids.tolist()
        values = lp.logprobs.tolist()
        ranks = lp.ranks.tolist()
        out = []
        for row_ids, row_values, rank in zip(ids, values, ranks, strict=True):
            position: PositionLogprobs = {}
            for j, (tid, value) in enumerate(zip(row_ids, row_values, strict=True)):
                if tid in position:
                    continue
                position[tid] = Logprob(value, rank if j == 0 else j, self._token_text(tid))
            out.append(position)
        return out

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _make_output(self, state: RequestState, now: float,
                     finished: list[str]) -> RequestOutput:
        completions = []
        for seq in state.sequences:
            request = seq.request
            finish_reason = request.status.finish_reason
            if finish_reason is not None and seq.index not in state.finished_seqs:
                state.finished_seqs.add(seq.index)
                self.seq_of.pop(request.request_id, None)
                finished.append(request.request_id)
            delta = ""
            if seq.detokenizer is not None:
                delta = seq.detokenizer.get_next_delta(finished=finish_reason is not None)
                seq.text += delta
            new_ids = request.output_token_ids[seq.num_sent_tokens:]
            seq.num_sent_tokens = request.num_output_tokens
            delta_lp = None
            if seq.logprobs is not None:
                delta_lp = seq.logprobs[seq.num_sent_logprobs:]
                seq.num_sent_logprobs = len(seq.logprobs)
            completions.append(CompletionOutput(
                index=seq.index, text=seq.text, token_ids=list(request.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs,
                finish_reason=finish_reason, stop_reason=seq.stop_reason, delta_text=delta,
                delta_token_ids=new_ids, delta_logprobs=delta_lp,
                forced_logprobs=_concat(seq.forced_logprobs) if finish_reason else None))
        state.metrics.num_preemptions = sum(s.request.num_preemptions for s in state.sequences)
        if state.finished:
            state.metrics.finished_time = now
            self.states.pop(state.request_id, None)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                             state.prompt_logprobs, completions, state.finished, state.metrics,
                             state.num_cached_tokens)


def _has_new_finish(state: RequestState) -> bool:
    return any(seq.request.is_finished and seq.index not in state.finished_seqs
               for seq in state.sequences)


def _concat(chunks: list[Any] | None) -> Any:
    if not chunks:
        return None
    return torch.cat(chunks)
