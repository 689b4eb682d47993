"""The engine's side of guided decoding: grammars compiled against the model's vocabulary
(cached by spec), a matcher per sequence, and each step's token bitmask.

Flow of one step (docs/structured_outputs.md): the runner queues the forward, then starts the
fill of the bitmask rows of the sequences that have a grammar and sample in this step on the
manager's fill thread (`start_fill`), and goes on with the host's work; when the step's sampling
is due it takes the mask (`finish_fill`) and the sampler applies it to the logits
(`masked_logits`). Backends: `xgrammar` (xgrammar_backend.py, the default) and `guidance`
(guidance.py, llguidance). The scheduler hands each sampled token to its sequence's matcher; a
matcher that reaches its end finishes the sequence.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import platform
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedserve.structured_output.drafts import accepted_prefix, draft_rows, fill_over_drafts
from pagedserve.structured_output.grammar import CACHE_ENTRIES, missing_package

if TYPE_CHECKING:
    from pagedserve.sampling_params import GuidedDecodingParams
    from pagedserve.structured_output.workers import GrammarWorkers, WorkerFill

logger = logging.getLogger(__name__)

# The packages guided requests need, per backend: xgrammar parses every spec (SamplingParams
# checks it when made) and applies masks on the CPU; `guidance` compiles and fills with
# llguidance.
BACKEND_PACKAGES = {"xgrammar": ("xgrammar",), "guidance": ("xgrammar", "llguidance")}
BACKENDS = tuple(BACKEND_PACKAGES)


def check_backend(name: str) -> None:
    """The backend is one we have; its packages are needed by guided requests only
    (`guided_decoding_unavailable`), so an engine starts without them."""
    if name not in BACKEND_PACKAGES:
        raise ValueError(f"guided_decoding_backend must be one of {', '.join(BACKENDS)}, "
                         f"got {name!r}")


def guided_decoding_unavailable(backend: str) -> str | None:
    """Why guided requests are refused here (a package `backend` needs is missing), or None."""
    # find_spec, not import: xgrammar takes seconds to import, and start-up asks too.
    for package in BACKEND_PACKAGES[backend]:
        if importlib.util.find_spec(package) is None:
            return missing_package(package)
    return None


class RequestGrammar:
    """One sequence's matcher and the number of its output tokens it has accepted."""

    def __init__(self, matcher: Any, ends_on_stop_token: bool = True,
                 validate_tokens: Callable[[Any, list[int]], int] = accepted_prefix) -> None:
        self.matcher = matcher
        self._validate_tokens = validate_tokens  # the backend's (drafts.py)
        # xgrammar's matcher ends by accepting a stop token (EOS or a stop id: not text);
        # llguidance's ends once nothing but EOS could follow, on an ordinary token.
        self.ends_on_stop_token = ends_on_stop_token
        # Only these tokens can end an xgrammar matcher: after any other one it is not asked
        # (a call into the library a row per step); None: asked after every token.
        self._ending_tokens: frozenset[int] | None = (
            frozenset(matcher.stop_token_ids) if ends_on_stop_token
            and hasattr(matcher, "stop_token_ids") else None)
        self.num_accepted = 0
        self.failed = False  # a token the grammar refused (never expected: the mask forbids it)
        # The grammar is complete and has accepted its stop token (the sequence ends). Kept
        # here, not asked of the matcher: the step path reads it several times per row.
        self.is_terminated = bool(matcher.is_terminated())

    def accept(self, token_id: int, position: int | None = None) -> bool:
        """Advance by the sequence's output token at `position` (None: the next one). With
        async scheduling the runner accepts a sample before the scheduler records it; the
        scheduler's call for the same position is then a no-op."""
        if position is not None and position < self.num_accepted:
            return not self.failed
        if self.failed or self.is_terminated:
            self.failed = True
            return False
        if not self.matcher.accept_token(token_id):
            self.failed = True
            return False
        self.num_accepted += 1
        if self._ending_tokens is None or token_id in self._ending_tokens:
            self.is_terminated = bool(self.matcher.is_terminated())
        return True

    def validate(self, token_ids: list[int]) -> int:
        """How many leading `token_ids` (a sequence's drafts) the grammar accepts after the
        tokens it has accepted; its state is left as it was."""
        if self.failed or self.is_terminated or not token_ids:
            return 0
        return self._validate_tokens(self.matcher, token_ids)

    def rollback_to(self, num_tokens: int) -> None:
        """Forget the accepted tokens beyond the first `num_tokens` (the sequence lost them)."""
        extra = self.num_accepted - num_tokens
        if extra > 0:
            self.matcher.rollback(extra)
            self.num_accepted = num_tokens
            self.is_terminated = bool(self.matcher.is_terminated())


@dataclass
class BitmaskFill:
    """A step's bitmask being filled: the rows it covers (None: every row) and the future of
    the filled host buffer (the fill thread) or the grammar workers' job."""

    rows: list[int] | None
    future: Future[torch.Tensor] | None = None
    job: WorkerFill | None = None


def resolve_workers(workers: int | None, device: torch.device, speculative: bool = False
                    ) -> int:
    """Grammar worker processes: as set, or by default 2 on x86-64 CUDA hosts with at least 8
    CPUs (each spins on a core of its own while guided requests run; on the H200's 16-CPU
    host 2 beat 1, 3, 4 and 8 at batch 64: docs/structured_outputs.md) and none elsewhere
    (the shared task's ordering rests on x86-64's: workers.py). None with speculative
    decoding: a guided request's drafts are checked against its matcher when scheduled, and
    its verify step's mask advances the matcher over them (drafts.py), which the workers'
    protocol does not do."""
    if workers is not None:
        if workers < 0:
            raise ValueError(f"guided_decoding_workers must be >= 0, got {workers}")
        if workers and speculative:
            raise ValueError(f"guided_decoding_workers {workers} with speculative decoding: "
                             "guided requests' drafts are checked by matchers in the engine's "
                             "process; use 0 (the default while speculating)")
        return workers
    if speculative:
        return 0
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return 2 if device.type == "cuda" and x86 and (os.cpu_count() or 1) >= 8 else 0


class StructuredOutputManager:
    """Compiles grammars for one tokenizer and vocabulary (the model's logits width) and fills
    the token bitmask of a step. Thread-safe for `compile`: the server compiles in worker
    threads before a request is added, so the engine thread finds the grammar in the cache."""

    def __init__(self, tokenizer: Any, vocab_size: int, device: torch.device,
                 max_num_reqs: int, backend: str = "xgrammar", workers: int | None = 0,
                 num_speculative_tokens: int = 0) -> None:
        check_backend(backend)
        # Set where the backend's packages are missing: guided requests are refused with it,
        # the others run.
        self.unavailable = guided_decoding_unavailable(backend)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.device = device
        self.max_num_reqs = max_num_reqs
        # Bitmask rows a step may need: 1+K per request in a step that verifies K drafts.
        self.max_rows = max_num_reqs * (1 + num_speculative_tokens)
        self.backend_name = backend
        self._backend: Any = None  # XGrammarBackend or GuidanceBackend, made on first use
        # The fill thread's two [max_rows, ceil(V / 32)] int32 host buffers, used in turn
        # (pinned on CUDA: a step's sampling reads one while the next step fills the other),
        # as tensors and as arrays, and the one filled last.
        self._bitmasks: list[torch.Tensor] = []
        self._bitmask_arrays: list[np.ndarray] = []
        self._buffer = 0
        # Per host buffer, the rows known to allow every token (allow_other_rows).
        self._all_allowed = [np.zeros(self.max_rows, dtype=bool) for _ in range(2)]
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        # One thread fills the masks: xgrammar fills without the GIL (engine/guided.py), so
        # the engine's thread goes on with the step's other host work meanwhile.
        self._fill_thread: ThreadPoolExecutor | None = None
        self._device_bitmask: torch.Tensor | None = None
        self._fill_started = threading.Event()
        # xgrammar's matchers in processes of their own (workers.py), started here so that
        # their start-up (seconds: torch and xgrammar) overlaps the model's loading; none:
        # the fill thread above (and none without xgrammar: no guided request will run).
        self.num_workers = (resolve_workers(workers, device, num_speculative_tokens > 0)
                            if backend == "xgrammar" and self.unavailable is None else 0)
        self._workers: GrammarWorkers | None = None
        if self.num_workers and tokenizer is not None:
            from pagedserve.structured_output.workers import GrammarWorkers

            info = self._ensure_backend().info
            self._workers = GrammarWorkers(
                self.num_workers, info.serialize_json(), info.stop_token_ids, vocab_size,
                max_num_reqs, pin=device.type == "cuda")
            logger.info("guided decoding: %d grammar worker processes", self.num_workers)
        # Bitmask work of the steps so far (benchmarks read these): the fills themselves, and
        # the engine thread's wait for them and the masks' copies.
        self.fill_seconds = 0.0
        self.wait_seconds = 0.0
        self.num_fills = 0
        self.num_repeats = 0  # of the fills, those a repeat_fill started

    def _ensure_backend(self) -> Any:
        with self._lock:
            if self._backend is None:
                if self.unavailable is not None:
                    raise ValueError(self.unavailable)
                if self.tokenizer is None:
                    raise ValueError("guided decoding needs the model's tokenizer, and this "
                                     "model has none")
                if self.backend_name == "guidance":
                    from pagedserve.structured_output.guidance import GuidanceBackend

                    self._backend = GuidanceBackend(self.tokenizer, self.vocab_size)
                else:
                    from pagedserve.structured_output.xgrammar_backend import XGrammarBackend

                    self._backend = XGrammarBackend(self.tokenizer, self.vocab_size)
            return self._backend

    def is_compiled(self, guided: GuidedDecodingParams) -> bool:
        """Whether the spec's grammar is in the cache (new_grammar then takes no time)."""
        with self._lock:
            return guided.key in self._cache

    def compile(self, guided: GuidedDecodingParams) -> Any:
        """The compiled grammar of a spec, from the cache or compiled now."""
        key = guided.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        backend = self._ensure_backend()
        t0 = time.perf_counter()
        compiled = backend.compile(key)
        logger.debug("compiled a %s grammar in %.3f s", key[0], time.perf_counter() - t0)
        if self._workers is not None:  # their own compilers, ahead of the grammar's matchers
            self._workers.compile(key)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def compile_all(self, specs: list[GuidedDecodingParams]) -> None:
        for spec in specs:
            self.compile(spec)

    def new_grammar(self, guided: GuidedDecodingParams, end_token_ids: frozenset[int]
                    ) -> RequestGrammar:
        """A fresh matcher for one sequence. Its stop tokens are the sequence's end tokens (EOS
        and stop ids), so the grammar allows them exactly where it may end; a sequence that
        ignores EOS still ends with its grammar, on the tokenizer's EOS."""
        compiled = self.compile(guided)
        stop = sorted(end_token_ids) or None
        if self._workers is not None:
            return self._workers.new_matcher(guided.key, stop)
        return RequestGrammar(self._backend.new_matcher(compiled, stop),
                              ends_on_stop_token=self.backend_name == "xgrammar",
                              validate_tokens=self._backend.validate_tokens)

    def start_fill(self, grammars: list[RequestGrammar], rows: list[int], num_rows: int,
                   drafts: list[list[int]] | None = None) -> BitmaskFill:
        """Start filling the [num_rows, ceil(V / 32)] int32 bitmask of `rows` from `grammars`
        (bit set: token allowed) on the fill thread or in the grammar workers, and return once
        the fill is under way. The grammars' matchers must not change until `finish_fill`.
        The fill's `rows` is None when its mask applies to every row: every row has a grammar,
        or (CUDA, the mask read in place) the other rows allow every token; else the other
        rows are left as they are and must not be applied. `drafts` (a verify step): grammar
        i's drafts, which it has accepted already (`RequestGrammar.validate`); its rows are
        rows[i] .. rows[i] + len(drafts[i]), the masks after 0 .. all of them (drafts.py)."""
        if self._workers is not None:
            assert drafts is None, "grammar workers run without speculative decoding"
            fill = BitmaskFill(rows, job=self._workers.start_fill(grammars, rows, num_rows))
            return self._cover(fill, fill.job.buffer, num_rows)
        fill = self._start_thread_fill(grammars, rows, num_rows, drafts)
        return self._cover(fill, self._buffer, num_rows)  # the buffer it fills

    def _cover(self, fill: BitmaskFill, buffer: int, num_rows: int) -> BitmaskFill:
        """The fill with `rows` None where its mask applies to every row (start_fill)."""
        assert fill.rows is not None
        if self._masks_every_row:
            allow_other_rows(self._host_masks[buffer], self._all_allowed[buffer], fill.rows,
                             num_rows)
            fill.rows = None
        elif len(fill.rows) == num_rows:
            fill.rows = None
        return fill

    def _start_thread_fill(self, grammars: list[RequestGrammar], rows: list[int],
                           num_rows: int, drafts: list[list[int]] | None) -> BitmaskFill:
        if not self._bitmasks:
            shape, pin = (self.max_rows, -(-self.vocab_size // 32)), self.device.type == "cuda"
            self._bitmasks = [torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)
                              for _ in range(2)]
            self._bitmask_arrays = [mask.numpy() for mask in self._bitmasks]
            self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="bitmask-fill")
        # A buffer is filled again two fills later. By then its step's samples, queued
        # behind its copy or the kernel reading it, have been waited for (the runner waits for
        # the last step's samples before it starts a fill, engine/guided.py): it has been read.
        self._buffer ^= 1
        bitmask = self._bitmasks[self._buffer][:num_rows]
        self._fill_started.clear()  # set by this fill's start (the thread runs one at a time)
        assert self._fill_thread is not None
        future = self._fill_thread.submit(self._fill, [g.matcher for g in grammars], bitmask,
                                          rows, drafts)
        # The fill thread needs the GIL to start (and to end). Wait here, without it, until
        # the fill is under way: this thread's Python work from here to `finish_fill` may
        # never let go of the GIL, and the fill would only start there.
        self._fill_started.wait()
        return BitmaskFill(rows if drafts is None else draft_rows(rows, drafts), future)

    @property
    def _masks_every_row(self) -> bool:
        """Whether a mixed step's mask covers every row (the rows without a grammar allowing
        every token): on CUDA, where the sampler's kernel reads a mask of every row in place
        (one launch), and a mask of some rows is copied and applied by xgrammar's kernel by
        row index (two launches and its wrapper)."""
        return self.device.type == "cuda" and self._host_mask_readable

    @property
    def _host_masks(self) -> list[np.ndarray]:
        """The two host bitmask buffers as arrays, by buffer number."""
        return self._bitmask_arrays if self._workers is None else self._workers.host_masks

    def repeat_fill(self, last: BitmaskFill, sampled: np.ndarray) -> BitmaskFill | None:
        """Start the fill of `last`'s grammar rows again, each grammar advanced by its row's
        sample (`sampled`: one per row): a decode step of the same requests, every row
        sampling. None where the general path (`start_fill` after each grammar's accept) is
        needed: the fill thread's matchers accept row by row anyway; see
        GrammarWorkers.repeat_fill for the workers."""
        if self._workers is None or last.job is None:
            return None
        job = self._workers.repeat_fill(last.job, sampled)
        if job is None:
            return None
        self.num_repeats += 1
        return self._cover(BitmaskFill(job.rows, job=job), job.buffer, job.num_rows)

    def _fill(self, matchers: list[Any], bitmask: torch.Tensor, rows: list[int],
              drafts: list[list[int]] | None = None) -> torch.Tensor:
        self._fill_started.set()
        t0 = time.perf_counter()
        if drafts is None:
            self._backend.fill(matchers, bitmask, rows)
        else:
            fill_over_drafts(self._backend.fill, matchers, bitmask, rows, drafts)
        self.fill_seconds += time.perf_counter() - t0
        self.num_fills += 1
        return bitmask

    def finish_fill(self, fill: BitmaskFill) -> torch.Tensor:
        """The started fill's mask for the sampler (waiting for the fill if need be): on CUDA
        it stays in its page-locked host buffer, which the sampler's kernel reads directly
        (`masked_logits`: no copy to launch), unless the workers' buffers could not be
        page-locked: then it is copied to the device first."""
        t0 = time.perf_counter()
        if fill.job is not None:
            assert self._workers is not None
            bitmask = self._workers.finish_fill(fill.job)
            self.fill_seconds += self._workers.last_fill_seconds
            self.num_fills += 1
        else:
            assert fill.future is not None
            bitmask = fill.future.result()
        if self.device.type == "cuda" and not self._host_mask_readable:
            if self._device_bitmask is None:
                # One device buffer: a step's copy into it follows, in stream order, the last
                # step's sampling that read it.
                self._device_bitmask = torch.empty(
                    (self.max_rows, -(-self.vocab_size // 32)), dtype=torch.int32,
                    device=self.device)
            # The host buffers are pinned (or page-locked shared memory): the copy need not
            # wait.
            bitmask = self._device_bitmask[:len(bitmask)].copy_(bitmask, non_blocking=True)
        self.wait_seconds += time.perf_counter() - t0
        return bitmask

    @property
    def _host_mask_readable(self) -> bool:
        """Whether the device can read the host bitmasks in place: the fill thread's are
        pinned; the workers' shared block is when its page-locking succeeded."""
        return self._workers is None or self._workers.registered

    def shutdown(self) -> None:
        if self._fill_thread is not None:
            self._fill_thread.shutdown(wait=True)
        if self._workers is not None:
            self._workers.shutdown()


def allow_other_rows(mask: np.ndarray, all_allowed: np.ndarray, rows: list[int],
                     num_rows: int) -> None:
    """Let every row of `mask[:num_rows]` but `rows` (which a fill is writing) allow every
    token, so the mask applies to every row of the step. `all_allowed` marks the rows of this
    buffer that allow every token already (from an earlier step: the buffers are reused): only
    the others are written, and the marks are brought up to date (`rows` are the grammars')."""
    other = np.ones(num_rows, dtype=bool)
    other[rows] = False
    stale = other & ~all_allowed[:num_rows]
    if stale.any():
        mask[:num_rows][stale] = -1
    all_allowed[:num_rows] = other


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None
                        ) -> None:
    """-inf, in place, on the logits of the tokens a row's bitmask forbids, for `rows` only
    (None: every row; xgrammar's kernel: C++ on the CPU, Triton on a GPU)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1],
                                    indices=rows)


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None,
                  temperature: torch.Tensor | None = None) -> torch.Tensor:
    """A float32 copy of `logits` with the bitmask applied to `rows` (None: every row), and
    every row divided by its `temperature` if given: on a GPU, for every row, one kernel of
    ours (masked_logits.py); else a clone and xgrammar's kernel."""
    if rows is None and logits.is_cuda:
        return _masked_logits_kernel()(logits, bitmask, temperature)
    logits = logits.clone()
    apply_token_bitmask(logits, bitmask, rows)
    return logits if temperature is None else logits / temperature.unsqueeze(1)


@functools.cache
def _masked_logits_kernel() -> Callable[..., torch.Tensor]:
    # Imported on first use: triton's import takes seconds, and the CPU's path needs none.
    from pagedserve.structured_output.masked_logits import masked_logits_triton

    return masked_logits_triton
