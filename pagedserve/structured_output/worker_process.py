"""A grammar worker process (workers.py has the engine's side and the shared layout): it
holds the matchers of its sequences, applies the engine's control messages, and on every step
accepts its rows' tokens and fills their bitmask rows.

    python -m pagedserve.structured_output.worker_process INDEX FD CONN_FD NUM_WORKERS
        MAX_ROWS WORDS INFO_OFFSET INFO_LENGTH PARENT_PID
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from pagedserve.structured_output.grammar import CACHE_ENTRIES, parse_grammar
from pagedserve.structured_output.workers import (
    COUNT_MOD,
    GO_WORD,
    IDLE_POLL_SECONDS,
    SPIN_SECONDS,
    SharedBlock,
    done_word,
    fill_ns_word,
)

logger = logging.getLogger(__name__)


def worker_main(index: int, fd: int, conn_fd: int, num_workers: int, max_rows: int, words: int,
                info_offset: int, info_length: int, parent_pid: int) -> None:
    """Map the engine's shared block, take the tokenizer's description from it, and serve."""
    mapping = mmap.mmap(fd, info_offset + info_length)
    os.close(fd)
    info_json = mapping[info_offset:info_offset + info_length].decode()
    shared = SharedBlock(memoryview(mapping), num_workers, max_rows, words)
    GrammarWorker(index, shared, Connection(conn_fd), info_json, parent_pid).run()


class GrammarWorker:
    """One worker: the matchers of its sequences by slot, its compiled grammars, and how many
    of the engine's control messages it has applied."""

    def __init__(self, index: int, shared: SharedBlock, conn: Connection, info_json: str,
                 parent_pid: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.index, self.shared, self.conn, self.parent_pid = index, shared, conn, parent_pid
        self.bitmasks = [torch.from_numpy(shared.bitmasks[b]) for b in range(2)]
        info = xgr.TokenizerInfo.deserialize_json(info_json)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)
        self.cache: collections.OrderedDict[tuple[str, str], Future] = collections.OrderedDict()
        # Compiles run on a thread of their own (xgrammar's compiler releases the GIL), so a
        # new schema compiling does not hold up the steps; a matcher of it waits for its
        # compile. The compile thread's Python (parsing a schema) takes the GIL for at most
        # the switch interval while this thread has a task.
        self.compile_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        sys.setswitchinterval(0.0005)
        self.matchers: dict[int, Any] = {}
        self.refused: set[int] = set()  # slots whose matcher refused a token
        self.handled = 0  # control messages applied
        self.seen = 0  # the last step counter acted on
        self.last_activity = time.perf_counter()

    def run(self) -> None:
        while self._wait_for_task() and self._run_task():
            pass

    # -- control messages -------------------------------------------------------------------

    def _read(self, timeout: float = 0) -> bool | None:
        """Apply the next message if one comes within `timeout` (None: none came; False: the
        engine said stop)."""
        if not self.conn.poll(timeout):
            return None
        self.handled += 1
        self.last_activity = time.perf_counter()
        return self._apply(self.conn.recv())

    def _apply(self, message: tuple) -> bool:
        kind = message[0]
        if kind == "compile":  # started; a failure is the engine's to report (it compiled too)
            self._compiled(message[1])
        elif kind == "new":
            _, slot, key, stop_ids = message
            self.refused.discard(slot)
            try:
                self.matchers[slot] = self._xgr.GrammarMatcher(
                    self._compiled(key).result(), override_stop_tokens=stop_ids)
            except Exception:  # compiled by the engine already: not expected
                logger.exception("grammar worker %d could not compile %s", self.index, key[0])
                self.matchers.pop(slot, None)
        elif kind == "drop":
            self.matchers.pop(message[1], None)
            self.refused.discard(message[1])
        elif kind == "accept":
            matcher = self.matchers.get(message[1])
            if matcher is not None and not all(matcher.accept_token(t) for t in message[2]):
                self.refused.add(message[1])
        elif kind == "rollback":
            matcher = self.matchers.get(message[1])
            if matcher is not None:
                matcher.rollback(message[2])
        return kind != "stop"

    def _compiled(self, key: tuple[str, str]) -> Future:
        compiled = self.cache.get(key)
        if compiled is None:
            compiled = self.cache[key] = self.compile_thread.submit(
                lambda: self.compiler.compile_grammar(parse_grammar(key)))
            if len(self.cache) > CACHE_ENTRIES:
                self.cache.popitem(last=False)
        self.cache.move_to_end(key)
        return compiled

    # -- steps ------------------------------------------------------------------------------

    def _wait_for_task(self) -> bool:
        """Until the step counter moves, apply messages as they come: spinning while tasks
        come often, blocked in a short poll of the pipe once they have stopped. False: stop
        (the engine said so, or has gone)."""
        ctrl, spins, idle = self.shared.ctrl, 0, False
        while ctrl[GO_WORD] == self.seen:
            spins += 1
            if idle or spins % 32 == 0:
                applied = self._read(IDLE_POLL_SECONDS if idle else 0)
                if applied is False:
                    return False
                if applied:
                    idle = False
                elif idle and os.getppid() != self.parent_pid:
                    return False
                elif spins % 1024 == 0:
                    idle = time.perf_counter() - self.last_activity > SPIN_SECONDS
        self.seen = ctrl[GO_WORD]
        return True

    def _run_task(self) -> bool:
        """Accept this worker's rows' tokens and fill their bitmask rows; then store the step
        number in its done word. False: the engine said stop."""
        shared, t0 = self.shared, time.perf_counter_ns()
        n, buffer = (int(x) for x in shared.header)
        # Messages sent ahead of the task (those sent after it may have been read already).
        behind = (int(shared.sent_before[self.index]) - self.handled) % COUNT_MOD
        for _ in range(behind if behind < COUNT_MOD // 2 else 0):
            if self._read(timeout=None) is False:
                return False
        table = shared.table[:, :n]
        mine = np.flatnonzero(table[3] == self.index)
        live, live_rows = [], []
        for i, slot, token, row in zip(mine.tolist(), table[0, mine].tolist(),
                                        table[1, mine].tolist(), table[2, mine].tolist(),
                                        strict=True):
            matcher = self.matchers.get(slot)
            if token >= 0 and matcher is not None and not matcher.accept_token(token):
                self.refused.add(slot)
            if matcher is None or slot in self.refused:  # it ends; its row is not used
                shared.refused[i] = 1
                self.bitmasks[buffer][row] = -1
                continue
            shared.refused[i] = 0
            live.append(matcher)
            live_rows.append(row)
        if live:
            self.batch.batch_fill_next_token_bitmask(live, self.bitmasks[buffer],
                                                     indices=live_rows)
        shared.ctrl[fill_ns_word(self.index)] = time.perf_counter_ns() - t0
        shared.ctrl[done_word(self.index)] = self.seen
        self.last_activity = time.perf_counter()
        return True


if __name__ == "__main__":
    try:
        worker_main(*(int(arg) for arg in sys.argv[1:]))
    except (EOFError, ConnectionError, KeyboardInterrupt):
        pass  # the engine's process has gone (or is being interrupted with it)
