"""Grammar matchers in processes of their own (`--guided-decoding-workers N`, xgrammar only):
the engine's side and the shared block's layout (worker_process.py is the workers' loop).

Why: on a fast GPU a small model's decode step is ~1.3 ms of host work at batch 64, and a
guided step adds the matchers' work (accepting the last samples, ~3 us a row; filling the next
masks, ~12 us a row for a JSON schema). On the engine's threads that work costs more than it
is: a hand-off between threads is a futex wake plus the GIL (~0.1 ms on the H200's host), and
Python between the library's calls competes with the engine for the GIL (docs/
structured_outputs.md, "Cost"). Here each worker process owns the matchers of some sequences
and has a GIL of its own. A step is a handful of stores into shared memory; the workers spin on
a counter (no wake-up: blocking on a pipe measured 0.06-0.1 worse in the ratio), accept their
rows' samples, fill their rows of a shared bitmask (page-locked on CUDA, so the sampler's
kernel reads it in place), and bump a counter back. The engine's thread writes the task and
goes on with the step; it spins only if the masks are not ready when the step's sampling is
due.

The engine side keeps, per sequence, a `RemoteGrammar`: the tokens accepted since the last
fill (sent with the next one), and whether the grammar has ended (an xgrammar matcher ends by
accepting one of its stop tokens, which its mask allows only where the grammar may end). A
matcher's creation, a rollback, extra pending tokens and a release are control messages on the
worker's pipe; each task names how many control messages precede it, so a worker has always
applied them first (messages sent after a task may be applied before it too: none of them
concerns a sequence in it). A decode step of the same requests repeats the last task with the
new samples in its token column (`repeat_fill`: no per-row accept here). A token
the grammar refuses (the mask makes it impossible) is known
only at the next fill: it comes back as a flag on that row, whose mask then allows every token,
and the sequence ends at the stop check after that one more, unconstrained, sample (the
engine's own matchers end it at the refused token).

Ordering: the engine writes the task, then the step counter; a worker writes its mask rows,
then its done word. Plain stores, kept in order by x86-64's memory model (TSO); other machines
get no workers by default (`manager.resolve_workers`).

Idle workers spin for a while after their last task, then poll their pipe (a step after a long
pause sends a wake-up first); a worker whose parent has gone exits.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection

import numpy as np
import torch

logger = logging.getLogger(__name__)

# A worker spins this long after its last task or message before it polls its pipe instead
# (a step arrives every 1-20 ms while requests run).
SPIN_SECONDS = 0.05
# Polling timeout of an idle worker; the engine sends a wake-up to one idle for longer.
IDLE_POLL_SECONDS = 0.002
WAKE_AFTER_SECONDS = 0.02
# The engine's wait for a worker: spins, then yields, and checks that the worker lives.
LIVENESS_SECONDS = 0.5

# The worker processes' entry point.
WORKER_MODULE = "pagedserve.structured_output.worker_process"
# Control words (int64), each on a cache line of its own: the step counter `go`, then per
# worker the last step it finished and that step's fill time.
_LINE = 8
GO_WORD = 0
# Control messages sent to a worker are counted modulo this in the task's int32 words.
COUNT_MOD = 1 << 31


def done_word(w: int) -> int:
    return (1 + 2 * w) * _LINE


def fill_ns_word(w: int) -> int:
    return (2 + 2 * w) * _LINE


class SharedBlock:
    """The shared block: control words; a step's task (every worker reads the rows it owns);
    two bitmask buffers."""

    def __init__(self, buf: memoryview, num_workers: int, max_rows: int, words: int) -> None:
        ctrl_bytes, task_ints = self._sizes(num_workers, max_rows)
        self.ctrl = buf[:ctrl_bytes].cast("q")  # scalar reads: faster than numpy's
        task = np.frombuffer(buf, np.int32, task_ints, ctrl_bytes)
        # Header: rows in the task, bitmask buffer; control messages sent to each worker
        # before the task. Columns: slot, token (-1: none), bitmask row, worker; refused.
        self.header = task[:2]
        self.sent_before = task[2:2 + num_workers]
        self.table = task[2 + num_workers:2 + num_workers + 4 * max_rows].reshape(4, max_rows)
        self.refused = task[2 + num_workers + 4 * max_rows:]
        mask_offset = -(-(ctrl_bytes + task_ints * 4) // 4096) * 4096
        self.bitmasks = np.frombuffer(buf, np.int32, 2 * max_rows * words, mask_offset
                                      ).reshape(2, max_rows, words)
        self.max_rows = max_rows

    @staticmethod
    def _sizes(num_workers: int, max_rows: int) -> tuple[int, int]:
        return (1 + 2 * num_workers) * _LINE * 8, 2 + num_workers + 5 * max_rows

    @classmethod
    def nbytes(cls, num_workers: int, max_rows: int, words: int) -> int:
        ctrl_bytes, task_ints = cls._sizes(num_workers, max_rows)
        return -(-(ctrl_bytes + task_ints * 4) // 4096) * 4096 + 2 * max_rows * words * 4

    def release(self) -> None:
        self.ctrl.release()
        self.header = self.sent_before = self.table = self.refused = None  # type: ignore
        self.bitmasks = None  # type: ignore[assignment]


class RemoteGrammar:
    """The engine's side of one sequence's matcher in a worker (RequestGrammar's interface)."""

    __slots__ = ("worker", "slot", "stop_ids", "num_accepted", "failed", "is_terminated",
                 "pending", "_pool", "__weakref__")
    ends_on_stop_token = True

    def __init__(self, pool: GrammarWorkers, worker: int, slot: int, stop_ids: frozenset[int]
                 ) -> None:
        self.worker, self.slot, self.stop_ids = worker, slot, stop_ids
        self.num_accepted = 0
        self.failed = False
        self.is_terminated = False
        self.pending: list[int] = []  # accepted here, not yet sent to the worker
        self._pool = pool

    def accept(self, token_id: int, position: int | None = None) -> bool:
        if position is not None and position < self.num_accepted:
            return not self.failed
        if self.failed or self.is_terminated:
            self.failed = True
            return False
        self.pending.append(token_id)
        self._pool.changed = True
        self.num_accepted += 1
        self.is_terminated = token_id in self.stop_ids
        return True

    def validate(self, token_ids: list[int]) -> int:
        raise RuntimeError("grammar workers run without speculative decoding "
                           "(manager.resolve_workers)")

    def rollback_to(self, num_tokens: int) -> None:
        extra = self.num_accepted - num_tokens
        if extra <= 0:
            return
        self._pool.changed = True
        unsent = min(extra, len(self.pending))
        del self.pending[len(self.pending) - unsent:]
        if extra > unsent:
            self._pool.send(self.worker, ("rollback", self.slot, extra - unsent))
        self.num_accepted = num_tokens
        self.is_terminated = False  # a stop token can only have been the last one


class WorkerFill:
    """A started fill: its task's number, bitmask buffer, the batch's size and the rows with a
    grammar (a list, and as an index), its grammars in task order, and the stop tokens of any
    of them."""

    __slots__ = ("go", "buffer", "num_rows", "rows", "row_index", "grammars", "stop_ids")

    def __init__(self, go: int, buffer: int, num_rows: int, rows: list[int],
                 row_index: np.ndarray, grammars: list[RemoteGrammar], stop_ids: np.ndarray
                 ) -> None:
        self.go, self.buffer, self.num_rows, self.grammars = go, buffer, num_rows, grammars
        self.rows, self.row_index, self.stop_ids = rows, row_index, stop_ids


class GrammarWorkers:
    """`num_workers` processes holding matchers; `start_fill` / `finish_fill` per step."""

    def __init__(self, num_workers: int, tokenizer_info_json: str, default_stop_ids: list[int],
                 vocab_size: int, max_rows: int, pin: bool) -> None:
        if not hasattr(os, "memfd_create"):
            raise ValueError("guided_decoding_workers needs Linux (memfd_create); use 0")
        self.num_workers = num_workers
        self.words = -(-vocab_size // 32)
        self.default_stop_ids = frozenset(default_stop_ids)
        # One memfd mapping, shared by passing its descriptor: nothing to name or unlink, and
        # it goes with the last process that maps it. The tokenizer's description for the
        # workers' compilers (~2 MB of JSON) follows the bitmasks.
        info = tokenizer_info_json.encode()
        size = SharedBlock.nbytes(num_workers, max_rows, self.words)
        self._fd = os.memfd_create("pagedserve-grammar")
        os.ftruncate(self._fd, size + len(info))
        self._map = mmap.mmap(self._fd, size + len(info))
        self._map[size:] = info
        self._shared = SharedBlock(memoryview(self._map), num_workers, max_rows, self.words)
        self._shared.bitmasks.fill(-1)
        self.bitmasks = torch.from_numpy(self._shared.bitmasks)  # [2, max_rows, words]
        self.host_masks = list(self._shared.bitmasks)  # the same, per buffer
        self._views: dict[tuple[int, int], torch.Tensor] = {}
        self.registered = pin and _register_pinned(self.bitmasks)
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        self._sent = [0] * num_workers  # control messages sent to each worker
        self._go = 0
        self._last_go = 0.0
        self._live = [0] * num_workers
        self._free: list[list[int]] = [[] for _ in range(num_workers)]
        self._next_slot = [0] * num_workers
        self._released: collections.deque[tuple[int, int]] = collections.deque()
        self._buffer = 0
        # A grammar accepted or lost a token outside a task, or refused one, since the last
        # task: `repeat_fill` must not assume the last task's grammars are as it left them.
        self.changed = False
        self._closed = False
        # Requests may be added, and grammars compiled, from other threads than the step's:
        # messages and slots.
        self._lock = threading.Lock()
        self.last_fill_seconds = 0.0  # the last step's fill in its slowest worker
        try:
            for w in range(num_workers):
                self._start_worker(w, size, len(info))
        except BaseException:
            self.shutdown()  # the workers started so far, the pin, the block
            raise

    def _start_worker(self, w: int, info_offset: int, info_length: int) -> None:
        ours, theirs = socket.socketpair()
        # A fresh interpreter running this module, not multiprocessing's spawn: that would
        # import the user's main script again (a script without a main guard would start its
        # work over in every worker).
        args = [str(x) for x in (w, self._fd, theirs.fileno(), self.num_workers,
                                 self._shared.max_rows, self.words, info_offset, info_length,
                                 os.getpid())]
        try:
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, *args], env=_child_env(),
                pass_fds=(self._fd, theirs.fileno())))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._conns.append(Connection(ours.detach()))

    # -- sequences --------------------------------------------------------------------------

    def new_matcher(self, key: tuple[str, str], stop_ids: list[int] | None) -> RemoteGrammar:
        """A matcher of the compiled `key` on the least loaded worker. Released slots are
        reused only from `start_fill`, once every worker is done with the last task: a slot
        dropped and made anew while a worker may still read a task naming it would take the
        old sequence's token."""
        with self._lock:
            w = min(range(self.num_workers), key=self._live.__getitem__)
            if self._free[w]:
                slot = self._free[w].pop()
            else:
                slot = self._next_slot[w]
                self._next_slot[w] += 1
            self._live[w] += 1
        self.send(w, ("new", slot, key, stop_ids))
        grammar = RemoteGrammar(self, w, slot,
                                frozenset(stop_ids) if stop_ids else self.default_stop_ids)
        # Called from wherever the grammar is collected: only a deque append there.
        weakref.finalize(grammar, self._released.append, (w, slot))
        return grammar

    def compile(self, key: tuple[str, str]) -> None:
        """Have every worker start compiling `key` (on its compile thread, beside the steps)
        before a matcher of it is made there: that matcher's message waits for the compile,
        inside a step."""
        for w in range(self.num_workers):
            self.send(w, ("compile", key))

    def _reuse_released(self) -> None:
        while self._released:
            w, slot = self._released.popleft()
            self.send(w, ("drop", slot))
            with self._lock:
                self._live[w] -= 1
                self._free[w].append(slot)

    def send(self, w: int, message: tuple) -> None:
        with self._lock:
            try:
                self._conns[w].send(message)
            except OSError:
                raise self._died(w) from None
            self._sent[w] += 1

    def _died(self, w: int) -> RuntimeError:
        return RuntimeError(f"grammar worker {w} died (exit code {self._procs[w].poll()})")

    # -- steps ------------------------------------------------------------------------------

    def start_fill(self, grammars: list[RemoteGrammar], rows: list[int], num_rows: int
                   ) -> WorkerFill:
        """Hand each grammar's pending tokens and bitmask row to its worker and start them."""
        self._ready_for_task()
        slots, tokens, workers = [], [], []
        for grammar in grammars:
            pending = grammar.pending
            if pending:
                if len(pending) > 1:  # rare: tokens accepted without a fill between
                    self.send(grammar.worker, ("accept", grammar.slot, pending[:-1]))
                tokens.append(pending[-1])
                pending.clear()
            else:
                tokens.append(-1)
            slots.append(grammar.slot)
            workers.append(grammar.worker)
        self._shared.table[:, :len(grammars)] = (slots, tokens, rows, workers)
        stop_ids = np.array(sorted(frozenset().union(*{g.stop_ids for g in grammars})),
                            dtype=np.int64)
        self._go_task(len(grammars))
        return WorkerFill(self._go, self._buffer, num_rows, rows, np.asarray(rows, np.int64),
                          grammars, stop_ids)

    def repeat_fill(self, last: WorkerFill, sampled: np.ndarray) -> WorkerFill | None:
        """`last` (the last task) again, each grammar advanced by its row's sample (`sampled`:
        one per row of the batch): the engine's side of a decode step whose batch keeps its
        requests, as array writes (no row by row accept, ~3 us a row on the step's critical
        path). None, and nothing done, where the general path is needed: another task came
        since, a grammar changed outside the tasks, or a token may end a grammar (it then gets
        no mask)."""
        if last.go != self._go or self.changed or len(sampled) != last.num_rows:
            return None
        tokens = sampled if len(last.rows) == last.num_rows else sampled[last.row_index]
        if (tokens[:, None] == last.stop_ids).any():
            return None
        self._ready_for_task()
        for grammar in last.grammars:  # what RemoteGrammar.accept would record
            grammar.num_accepted += 1
        self._shared.table[1, :len(tokens)] = tokens  # slots, rows, workers: as they were
        self._go_task(len(tokens))
        return WorkerFill(self._go, self._buffer, last.num_rows, last.rows, last.row_index,
                          last.grammars, last.stop_ids)

    def _ready_for_task(self) -> None:
        for w in range(self.num_workers):  # done with the last task (a fill left unfinished)
            self._wait(w)
        self._reuse_released()
        self._buffer ^= 1  # see StructuredOutputManager.start_fill on reusing a buffer

    def _go_task(self, n: int) -> None:
        """Start the task whose first `n` table columns are written."""
        now = time.perf_counter()
        if now - self._last_go > WAKE_AFTER_SECONDS:
            for w in range(self.num_workers):
                self.send(w, ("wake",))  # they may be polling their pipes
        shared = self._shared
        shared.header[:] = n, self._buffer
        shared.sent_before[:] = [sent % COUNT_MOD for sent in self._sent]
        self.changed = False
        self._go += 1
        self._last_go = now
        shared.ctrl[GO_WORD] = self._go  # last: a worker reads the task after it

    def finish_fill(self, fill: WorkerFill) -> torch.Tensor:
        """The filled host bitmask [num_rows, words] once every worker is done."""
        ctrl = self._shared.ctrl
        for w in range(self.num_workers):
            self._wait(w)
        self.last_fill_seconds = max(ctrl[fill_ns_word(w)] for w in range(self.num_workers)) / 1e9
        refused = self._shared.refused[:len(fill.grammars)]
        if np.count_nonzero(refused):  # a quarter of .any()'s time at 64 rows
            self.changed = True
            for i in np.flatnonzero(refused).tolist():
                grammar = fill.grammars[i]
                grammar.failed = True
                logger.error("a grammar refused its sequence's token (worker %d, slot %d)",
                             grammar.worker, grammar.slot)
        view = self._views.get((fill.buffer, fill.num_rows))
        if view is None:  # a tensor view costs a few us to make: one per buffer and size
            view = self._views[fill.buffer, fill.num_rows] = self.bitmasks[fill.buffer,
                                                                          :fill.num_rows]
        return view

    def _wait(self, w: int) -> None:
        ctrl, index, go = self._shared.ctrl, done_word(w), self._go
        if ctrl[index] == go:
            return
        t0 = time.perf_counter()
        spins = 0
        while ctrl[index] != go:
            spins += 1
            if spins % 256 == 0:
                time.sleep(0)  # let the process's other threads run
                if time.perf_counter() - t0 > LIVENESS_SECONDS:
                    if self._procs[w].poll() is not None:
                        raise self._died(w)
                    t0 = time.perf_counter()

    # -- life -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:  # a compile may be sending from another thread
            for conn in self._conns:
                try:
                    conn.send(("stop",))
                except OSError:
                    pass
        for proc, conn in zip(self._procs, self._conns, strict=True):
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            conn.close()
        if self.registered:
            try:
                torch.cuda.synchronize()  # a queued sampling kernel may still read the masks
            except RuntimeError as exc:  # a broken context runs nothing more
                logger.warning("grammar workers' shutdown: %s", exc)
            torch.cuda.cudart().cudaHostUnregister(self.bitmasks.data_ptr())
        # The mapping stays while a mask taken from it lives; it goes with the last reference.
        self.bitmasks = None  # type: ignore[assignment]
        self._views.clear()
        self.host_masks.clear()
        self._shared.release()
        os.close(self._fd)


def _child_env() -> dict[str, str]:
    """The environment with this package importable, however the engine found it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _register_pinned(bitmasks: torch.Tensor) -> bool:
    """Page-lock the shared bitmasks so the device reads them directly (the sampler's kernel,
    or a copy)."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(
            bitmasks.data_ptr(), bitmasks.numel() * bitmasks.element_size(), 0)
    except Exception as exc:  # an old torch without the binding
        logger.warning("could not pin the grammar workers' bitmasks: %s", exc)
        return False
    if int(err) != 0:
        logger.warning("could not pin the grammar workers' bitmasks (CUDA error %d)", int(err))
        return False
    return True
