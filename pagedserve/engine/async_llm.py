"""AsyncLLM: an LLMEngine driven by a background thread, one output stream per request.

The engine is not thread-safe, so the event loop never touches it: adds and aborts are queued as
commands that the engine thread applies between steps, and each step's outputs go back to the
loop in one `call_soon_threadsafe` hop, into per-request asyncio queues.

With the engine core in this process the thread runs the steps. With a core process
(`--engine-core-process`) the steps run there and this thread only sends the commands, waits
on the output socket (the GIL released) and turns the core's outputs into RequestOutputs
(detokenization, stop strings), so neither the event loop nor the text work stalls the core.
A core process that dies fails every open request and /health within a second.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pagedserve.config import EngineConfig
from pagedserve.engine.core_client import EngineDeadError
from pagedserve.engine.llm_engine import EngineStats, LLMEngine
from pagedserve.engine.outputs import RequestOutput
from pagedserve.pooling import PoolingParams
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


__all__ = ["AsyncLLM", "EngineDeadError", "QueueFullError", "RequestStream"]


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later."""


class OutputObserver(Protocol):
    """Told about every output in the engine thread (the server's metrics implement this)."""

    def observe_output(self, output: RequestOutput, inter_token_latency: float | None) -> None: ...

    def observe_abort(self) -> None: ...


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine counters published by the engine thread after every step and command batch."""

    stats: EngineStats
    num_blocks: int
    num_free_blocks: int  # free or cached-evictable: not held by any request
    max_num_running: int  # most requests in one step since start
    num_steps: int
    num_aborted: int
    applied_seqs: int  # sequences of the adds applied (or refused) so far


class _Aborted:
    """Queue sentinel: the request was aborted; its stream ends."""


ABORTED = _Aborted()


class RequestStream:
    """The outputs of one request, in order; iterate it with `async for`."""

    def __init__(self, request_id: str, owner: AsyncLLM) -> None:
        self.request_id = request_id
        self.owner = owner
        self.queue: asyncio.Queue[RequestOutput | BaseException | _Aborted] = asyncio.Queue()
        self.finished = False
        self.aborted = False
        self.last_token_time: float | None = None  # engine thread only
        self._held: RequestOutput | BaseException | _Aborted | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        """The next output; when several wait (the consumer fell behind the engine, as a busy
        server's streams do), one output that merges them: their deltas joined, the latest
        cumulative fields. A slow stream then writes fewer, longer chunks."""
        if self.finished or self.aborted:
            raise StopAsyncIteration
        item, self._held = self._held, None
        if item is None:
            item = await self.queue.get()
        while isinstance(item, RequestOutput) and not item.finished and not self.queue.empty():
            later = self.queue.get_nowait()
            if not isinstance(later, RequestOutput):
                self._held = later  # an error or abort ends the stream after this output
                break
            item = merge_outputs(item, later)
        if isinstance(item, _Aborted):
            self.aborted = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.aborted = True
            raise item
        self.finished = item.finished
        return item

    async def final(self) -> RequestOutput:
        """Consume the stream; the last (finished) output."""
        last = None
        async for output in self:
            last = output
        if last is None or not last.finished:
            raise EngineDeadError(f"request {self.request_id} was aborted")
        return last

    def close(self) -> None:
        """Abort the request unless it already finished (safe to call more than once)."""
        if not self.finished and not self.aborted:
            self.aborted = True
            self.owner.abort_nowait(self.request_id)


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """`later` with `earlier`'s deltas in front of its own, sequence by sequence (the
    cumulative text, token ids and logprobs are `later`'s already)."""
    completions = {c.index: c for c in later.outputs}
    for old in earlier.outputs:
        new = completions.get(old.index)
        if new is None:
            completions[old.index] = old
            continue
        new.delta_text = old.delta_text + new.delta_text
        new.delta_token_ids = old.delta_token_ids + new.delta_token_ids
        if old.delta_logprobs is not None or new.delta_logprobs is not None:
            new.delta_logprobs = (old.delta_logprobs or []) + (new.delta_logprobs or [])
    later.outputs = sorted(completions.values(), key=lambda c: c.index)
    return later


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None
    stream: RequestStream
    ack: asyncio.Future[None]
    prompt_text: str | None = None  # the text of a prompt tokenized by the caller
    pooling: PoolingParams | None = None  # an embedding request's (pooling/)
    lora_request: Any = None  # a pagedserve.lora.LoRARequest (None: the base model)
    # {"image": [...]} or a MultiModalPrompt processed already (LLMEngine.add_request).
    multi_modal_data: Any = None


@dataclass
class _Abort:
    request_id: str
    done: asyncio.Future[None] | None


@dataclass
class _Call:
    """A core utility call ("stats", "reset_prefix_cache", "ping") made between steps."""

    name: str
    done: asyncio.Future[Any]


class AsyncLLM:
    """`await add_request(...)` -> RequestStream, or `async for out in generate(...)`.

    A request the engine refuses (ValueError) raises in its caller only; a stream dropped before
    it finishes (client disconnect, task cancellation) aborts its request, freeing its KV blocks
    before the next step.
    """

    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 4096,
                 observer: OutputObserver | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.observer = observer
        self.error: BaseException | None = None
        # Called in the engine thread once a step has failed and the engine's state is unknown
        # (the server then exits, so a supervisor can restart it).
        self.on_dead: Callable[[], None] | None = None
        self._commands: deque[_Add | _Abort | _Call] = deque()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sent_seqs = 0  # event loop only: sequences of every add sent
        self._applied_seqs = 0  # engine thread only: of every add applied (or refused)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._num_steps = 0
        self._num_aborted = 0
        self._max_num_running = 0
        self.snapshot = self._take_snapshot()
        # A core process that dies wakes the engine thread, which fails every request.
        engine.on_core_death(self._wakeup.set)

    @classmethod
    def from_kwargs(cls, **engine_args: Any) -> AsyncLLM:
        return cls(LLMEngine(EngineConfig.from_kwargs(**engine_args)))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- event-loop side ----------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedserve-engine",
                                            daemon=True)
            self._thread.start()

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams, cache_salt: str | None = None,
                          arrival_time: float | None = None,
                          prompt_text: str | None = None,
                          pooling: PoolingParams | None = None,
                          lora_request: Any = None,
                          multi_modal_data: Any = None) -> RequestStream:
        """Queue a request and wait until the engine thread accepted it (within one step).
        `prompt_text`: the text of `prompt` when the caller tokenized it (for echo).
        `pooling`: an embedding request of a pooling model (`params` then only counts it as one
        sequence); its stream's one output is a PoolingRequestOutput.

        Raises ValueError for a request the engine refuses, QueueFullError when it would make
        more than `max_waiting_requests` sequences wait, and EngineDeadError when the engine is
        not running. `multi_modal_data`: the prompt's images (LLMEngine.add_request)."""
        self._check_alive()
        waiting = self.num_waiting()
        if waiting + params.n > self.max_waiting_requests:
            raise QueueFullError(f"the server has {waiting} sequences waiting, and this request's"
                                 f" {params.n} would pass the limit of "
                                 f"{self.max_waiting_requests}; try again later")
        self.start()
        loop = asyncio.get_running_loop()
        self._loop = loop
        stream = RequestStream(request_id, self)
        ack: asyncio.Future[None] = loop.create_future()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._sent_seqs += params.n
        self._send(_Add(request_id, prompt, params, arrival, cache_salt, stream, ack,
                        prompt_text, pooling, lora_request, multi_modal_data))
        try:
            await ack
        except asyncio.CancelledError:
            # The add may still be applied after we gave up on it: abort it behind the add.
            self.abort_nowait(request_id)
            raise
        return stream

    def num_waiting(self) -> int:
        """Sequences waiting: the engine's queue, and adds sent that it has not applied yet
        (counted once: the engine publishes its queue and its applied count together)."""
        snap = self.snapshot
        return snap.stats.num_waiting + self._sent_seqs - snap.applied_seqs

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       cache_salt: str | None = None, multi_modal_data: Any = None
                       ) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params, cache_salt,
                                        multi_modal_data=multi_modal_data)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort_nowait(self, request_id: str) -> None:
        """Abort from anywhere (also from a `finally` while being cancelled); no waiting."""
        self._send(_Abort(request_id, None))

    async def abort(self, request_id: str) -> None:
        """Abort and wait until the engine thread has freed the request's blocks."""
        self._check_alive()
        done = asyncio.get_running_loop().create_future()
        self._send(_Abort(request_id, done))
        await done

    async def call_utility(self, name: str) -> Any:
        """A core utility ("stats": the core's current CoreStats, "reset_prefix_cache",
        "ping"), called by the engine thread between steps."""
        self._check_alive()
        done = asyncio.get_running_loop().create_future()
        self._loop = asyncio.get_running_loop()
        self.start()
        self._send(_Call(name, done))
        return await done

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every request, stop the engine thread and end all open streams; then stop the
        core process, if there is one."""
        self._stop = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.shutdown()  # the core process and the model's other ranks, if any

    def _send(self, command: _Add | _Abort | _Call) -> None:
        self._commands.append(command)
        self._wakeup.set()

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        if self._stop:
            raise EngineDeadError("the engine is shut down")

    # ---- engine-thread side -------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._wakeup.clear()
                self.engine.check_alive()
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    # A core process's messages that came late (the stats after an abort).
                    self._dispatch(self.engine.step(timeout=0))
                    self._publish()
                    self._wakeup.wait(self.engine.idle_poll_s)
                    continue
                outputs = self.engine.step()
                self._num_steps += 1
                self._max_num_running = max(self._max_num_running, len(outputs),
                                            self.engine.core_stats().num_running)
                self._dispatch(outputs)
                self._publish()
            self._apply_commands()
            self._fail_all(EngineDeadError("the engine is shut down"))
        except BaseException as exc:  # a crashed step: every open request fails, loudly
            logger.exception("engine thread crashed")
            self.error = exc
            self._fail_all(EngineDeadError(f"the engine stopped: {exc!r}"))
            if self.on_dead is not None:
                self.on_dead()

    def _apply_commands(self) -> None:
        deliveries: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, _Add):
                deliveries.append(self._apply_add(command))
            elif isinstance(command, _Call):
                try:
                    deliveries.append((_deliver, (command.done, self.engine.call_utility(
                        command.name), None)))
                except Exception as exc:
                    deliveries.append((_deliver, (command.done, None, exc)))
            else:
                stream = self._streams.pop(command.request_id, None)
                if stream is not None:
                    self.engine.abort_request(command.request_id)
                    self._num_aborted += 1
                    if self.observer is not None:
                        self.observer.observe_abort()
                    deliveries.append((stream.queue.put_nowait, (ABORTED,)))
                if command.done is not None:
                    deliveries.append((_resolve, (command.done, None)))
        if deliveries:
            self._publish()
            self._call_in_loop(deliveries)

    def _apply_add(self, command: _Add) -> tuple[Callable[..., None], tuple[Any, ...]]:
        try:
            if command.request_id in self._streams:
                raise ValueError(f"request id {command.request_id!r} is already in use")
            if command.pooling is not None:
                self.engine.add_pooling_request(command.request_id, command.prompt,
                                                command.pooling, command.arrival_time,
                                                prompt_text=command.prompt_text)
            else:
                self.engine.add_request(command.request_id, command.prompt, command.params,
                                        command.arrival_time, command.cache_salt,
                                        prompt_text=command.prompt_text,
                                        lora_request=command.lora_request,
                                        multi_modal_data=command.multi_modal_data)
        except Exception as exc:  # the caller's error; the other requests never see it
            return _resolve, (command.ack, exc)
        finally:
            self._applied_seqs += command.params.n
        self._streams[command.request_id] = command.stream
        return _resolve, (command.ack, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        deliveries: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            self._observe(stream, output)
            if output.finished:
                del self._streams[output.request_id]
            deliveries.append((stream.queue.put_nowait, (output,)))
        self._call_in_loop(deliveries)

    def _observe(self, stream: RequestStream, output: RequestOutput) -> None:
        token_time = output.metrics.last_token_time if output.metrics else None
        interval = None
        if stream.last_token_time is not None and token_time is not None:
            interval = token_time - stream.last_token_time
        stream.last_token_time = token_time
        if self.observer is not None:
            self.observer.observe_output(output, interval)

    def _fail_all(self, error: BaseException) -> None:
        if self._streams:
            self.engine.abort_request(list(self._streams))
        deliveries: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
            (stream.queue.put_nowait, (error,)) for stream in self._streams.values()]
        self._streams.clear()
        while self._commands:
            command = self._commands.popleft()
            future = command.ack if isinstance(command, _Add) else command.done
            if future is not None:
                deliveries.append((_resolve, (future, error)))
        self._publish()
        self._call_in_loop(deliveries)

    def _call_in_loop(self, deliveries: list[tuple[Callable[..., None], tuple[Any, ...]]]
                      ) -> None:
        """One loop wake-up per batch of deliveries, not one per request."""
        if not deliveries or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_run_all, deliveries)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    def _publish(self) -> None:
        self.snapshot = self._take_snapshot()

    def _take_snapshot(self) -> EngineSnapshot:
        core = self.engine.core_stats()
        return EngineSnapshot(self.engine.stats(), core.num_blocks, core.num_free_blocks,
                              self._max_num_running, self._num_steps, self._num_aborted,
                              self._applied_seqs)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _run_all(deliveries: list[tuple[Callable[..., None], tuple[Any, ...]]]) -> None:
    for fn, args in deliveries:
        fn(*args)
