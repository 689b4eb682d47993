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
    """A worker's loop: control messages as they come, a task whenever `go` moves."""
    import xgrammar as xgr

    from pagedserve.structured_output.grammar import CACHE_ENTRIES, parse_grammar

    mapping = mmap.mmap(fd, info_offset + info_length)
    os.close(fd)
    conn = Connection(conn_fd)
    shared = SharedBlock(memoryview(mapping), num_workers, max_rows, words)
    bitmasks = [torch.from_numpy(shared.bitmasks[b]) for b in range(2)]
    ctrl = shared.ctrl
    info = xgr.TokenizerInfo.deserialize_json(
        mapping[info_offset:info_offset + info_length].decode())
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    cache: collections.OrderedDict[tuple[str, str], Future] = collections.OrderedDict()
    # Compiles run on a thread of their own (xgrammar's compiler releases the GIL), so a new
    # schema compiling does not hold up the steps; a matcher of it waits for its compile.
    compile_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
    # The compile thread's Python (parsing a schema) takes the GIL for at most this long
    # while this thread has a task.
    sys.setswitchinterval(0.0005)

    def compile_key(key: tuple[str, str]) -> Future:
        compiled = cache.get(key)
        if compiled is None:
            compiled = cache[key] = compile_thread.submit(
                lambda: compiler.compile_grammar(parse_grammar(key)))
            if len(cache) > CACHE_ENTRIES:
                cache.popitem(last=False)
        cache.move_to_end(key)
        return compiled
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    matchers: dict[int, Any] = {}
    refused: set[int] = set()
    handled = seen = 0

    def handle(message: tuple) -> bool:
        kind = message[0]
        if kind == "compile":  # started; a failure is the engine's to report (it compiled too)
            compile_key(message[1])
        elif kind == "new":
            _, slot, key, stop_ids = message
            refused.discard(slot)
            try:
                matchers[slot] = xgr.GrammarMatcher(compile_key(key).result(),
                                                    override_stop_tokens=stop_ids)
            except Exception:  # compiled by the engine already: not expected
                logger.exception("grammar worker %d could not compile %s", index, key[0])
                matchers.pop(slot, None)
        elif kind == "drop":
            matchers.pop(message[1], None)
            refused.discard(message[1])
        elif kind == "accept":
            matcher = matchers.get(message[1])
            if matcher is not None and not all(matcher.accept_token(t) for t in message[2]):
                refused.add(message[1])
        elif kind == "rollback":
            matcher = matchers.get(message[1])
            if matcher is not None:
                matcher.rollback(message[2])
        return kind != "stop"

    last = time.perf_counter()
    while True:
        # Wait for a task, handling messages meanwhile: spinning while tasks come often,
        # blocked in a short poll of the pipe once they have stopped.
        spins, idle = 0, False
        while ctrl[GO_WORD] == seen:
            spins += 1
            if idle or spins % 32 == 0:
                if conn.poll(IDLE_POLL_SECONDS if idle else 0):
                    handled += 1
                    if not handle(conn.recv()):
                        return
                    last, idle = time.perf_counter(), False
                elif idle and os.getppid() != parent_pid:
                    return
                elif spins % 1024 == 0:
                    idle = time.perf_counter() - last > SPIN_SECONDS
        seen = ctrl[GO_WORD]
        t0 = time.perf_counter_ns()
        n, buffer = (int(x) for x in shared.header)
        # Messages sent ahead of the task (those sent after it may have been read already).
        behind = (int(shared.sent_before[index]) - handled) % COUNT_MOD
        for _ in range(behind if behind < COUNT_MOD // 2 else 0):
            handled += 1
            if not handle(conn.recv()):
                return
        table = shared.table[:, :n]
        mine = np.flatnonzero(table[3] == index)
        live, live_rows = [], []
        for i, slot, token, row in zip(mine.tolist(), table[0, mine].tolist(),
                                        table[1, mine].tolist(), table[2, mine].tolist(),
                                        strict=True):
            matcher = matchers.get(slot)
            if token >= 0 and matcher is not None and not matcher.accept_token(token):
                refused.add(slot)
            if matcher is None or slot in refused:  # the sequence ends; its row is not used
                shared.refused[i] = 1
                bitmasks[buffer][row] = -1
                continue
            shared.refused[i] = 0
            live.append(matcher)
            live_rows.append(row)
        if live:
            batch.batch_fill_next_token_bitmask(live, bitmasks[buffer], indices=live_rows)
        ctrl[fill_ns_word(index)] = time.perf_counter_ns() - t0
        ctrl[done_word(index)] = seen
        last = time.perf_counter()


if __name__ == "__main__":
    try:
        worker_main(*(int(arg) for arg in sys.argv[1:]))
    except (EOFError, ConnectionError, KeyboardInterrupt):
        pass  # the engine's process has gone (or is being interrupted with it)
