"""The engine core in a process of its own, and the messages it exchanges with the front.

```
front (LLMEngine + MPClient)                    core process (CoreLoop)
  CoreInput  --PUSH ipc:// input socket-->  input thread: recv, decode -> queue
                                            busy loop: apply adds/aborts/utility calls,
                                                       EngineCore.step()
  StepOutput <--PULL ipc:// output socket-- output thread: encode, send (one per step)
```

Messages are msgspec msgpack; a numpy array travels as one extension value (dtype, shape, raw
bytes), never pickled. The socket I/O and encoding run in two threads so that they overlap the
step (torch and zmq release the GIL while they wait). The output queue is bounded: a front that
falls behind blocks the output thread, then the loop, instead of growing memory. Start-up
(model load, cache sizing) reports through a pipe: the core's `CoreInfo`, or its error as one
line. The loop exits on a shutdown message, when the front's process is gone, or after a step
fails (its error goes out first as the last message).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import shutil
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import torch

from pagedserve import envs
from pagedserve.config import EngineConfig
from pagedserve.engine.core import EngineCore
from pagedserve.engine.core_messages import CoreRequest, CoreStats, StepOutput
from pagedserve.engine.gc_heap import freeze_startup_heap
from pagedserve.process_start import take_environment
from pagedserve.sampling_params import specs_parsed_by_sender

logger = logging.getLogger(__name__)

_NDARRAY_EXT = 1
_TENSOR_EXT = 2
# Steps the output thread may lag behind the loop before the loop waits (back-pressure).
OUTPUT_QUEUE_STEPS = 8
SOCKET_HWM = 64


class CoreInput(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything the front queued since its last flush, applied before the next step."""

    adds: list[list[CoreRequest]] = msgspec.field(default_factory=list)  # a request's sequences
    aborts: list[str] = msgspec.field(default_factory=list)
    stopped: list[str] = msgspec.field(default_factory=list)  # ended by a stop string
    utility: list[tuple[int, str]] = msgspec.field(default_factory=list)  # (call id, name)
    shutdown: bool = False


class StepMessage(msgspec.Struct, array_like=True, omit_defaults=True):
    """One output message: a step's outputs, or the error that ended the core."""

    output: StepOutput | None = None
    stats: CoreStats | None = None
    error: str | None = None


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):  # an image's processed inputs (CoreFeature.data)
        t = obj.detach().cpu().contiguous()
        header = msgspec.msgpack.encode((str(t.dtype).removeprefix("torch."), list(t.shape)))
        body = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return msgspec.msgpack.Ext(_TENSOR_EXT, len(header).to_bytes(4, "little") + header
                                   + body)
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        header = msgspec.msgpack.encode((arr.dtype.str, arr.shape))
        return msgspec.msgpack.Ext(_NDARRAY_EXT,
                                   len(header).to_bytes(4, "little") + header + arr.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code not in (_NDARRAY_EXT, _TENSOR_EXT):
        raise NotImplementedError(f"unknown msgpack extension {code}")
    n = int.from_bytes(data[:4], "little")
    dtype, shape = msgspec.msgpack.decode(data[4:4 + n])
    if code == _TENSOR_EXT:
        body = bytearray(data[4 + n:])  # writable: the tensor owns a copy
        flat = (torch.frombuffer(body, dtype=torch.uint8) if body
                else torch.empty(0, dtype=torch.uint8))
        return flat.view(getattr(torch, dtype)).reshape(shape)
    return np.frombuffer(data[4 + n:], dtype=np.dtype(dtype)).reshape(shape)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def decoder(kind: type) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind, ext_hook=_ext_hook)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, conn: Connection,
                    log_level: int, log_stats: bool, parent_pid: int,
                    environ: dict[str, str] | None = None) -> None:
    """The core process's entry point (a daemon process; `environ`: its front's environment,
    where it was forked from a forkserver)."""
    take_environment(environ)
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s [engine core] %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: the front decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The core is a daemon (it must not outlive the front), but with tensor parallelism it
    # starts the other ranks' processes, which multiprocessing refuses to a daemon. It stops
    # them itself (EngineCore.shutdown), and they exit when their pipes close.
    multiprocessing.current_process()._config["daemon"] = False
    try:
        core = EngineCore(config, log_stats=log_stats)
        info = core.info()
    except BaseException as exc:  # the front shows this line instead of waiting forever
        logger.debug("start-up failed", exc_info=True)
        conn.send(("error", type(exc).__name__, one_line(exc)))
        conn.close()
        return
    conn.send(("ready", info))
    conn.close()
    freeze_startup_heap()
    # The process whose exit tells the front's: the front itself, or, forked from a
    # forkserver, the forkserver, which exits with its front.
    watched = parent_pid if environ is None else os.getppid()
    loop = CoreLoop(core, input_addr, output_addr, watched)
    profile_path = envs.PAGEDSERVE_CORE_PROFILE
    if not profile_path:
        loop.run()
        return
    import cProfile

    profiler = cProfile.Profile()
    try:
        profiler.runcall(loop.run)
    finally:  # written whole, then renamed: a reader never sees half a file
        profiler.dump_stats(profile_path + ".part")
        os.replace(profile_path + ".part", profile_path)


class CoreLoop:
    def __init__(self, core: EngineCore, input_addr: str, output_addr: str,
                 parent_pid: int) -> None:
        self.core = core
        self.input_addr = input_addr
        self.output_addr = output_addr
        self.parent_pid = parent_pid
        self.inputs: queue.Queue[CoreInput | None] = queue.Queue()
        self.outputs: queue.Queue[StepMessage | None] = queue.Queue(OUTPUT_QUEUE_STEPS)
        self.stop = threading.Event()

    def run(self) -> None:
        import zmq

        ctx = zmq.Context()
        threads = [threading.Thread(target=self._read_inputs, args=(ctx,), daemon=True,
                                    name="core-input"),
                   threading.Thread(target=self._write_outputs, args=(ctx,), daemon=True,
                                    name="core-output")]
        for thread in threads:
            thread.start()
        try:
            self._loop()
        except BaseException as exc:
            logger.exception("engine core step failed")
            self._put(StepMessage(error=one_line(exc)))
        finally:
            self.stop.set()
            self.core.shutdown()  # the model's other ranks, if any
            try:
                self.outputs.put(None, timeout=5.0)
            except queue.Full:  # the output thread is stuck on a gone front: leave it
                pass
            for thread in threads:
                thread.join(5)
            ctx.destroy(linger=0)
            if os.getppid() != self.parent_pid:  # nobody else will remove the sockets
                shutil.rmtree(os.path.dirname(self.input_addr.removeprefix("ipc://")),
                              ignore_errors=True)

    def _loop(self) -> None:
        core = self.core
        while True:
            idle = not core.has_unfinished_requests()
            out = StepOutput()
            applied = self._apply_inputs(out, block=idle)
            if applied is None:
                return
            if core.has_unfinished_requests():
                step = core.step()
                step.utility, step.failed = out.utility, out.failed
                out = step
            elif idle and os.getppid() != self.parent_pid:
                logger.warning("the front process is gone: the engine core exits")
                return
            elif idle:
                core.check_health()  # a rank lost while idle fails the core now
            # With no step to report, the front still learns what its aborts freed.
            if (not out.is_empty or applied) and not self._put(StepMessage(out, core.stats())):
                return

    def _put(self, msg: StepMessage) -> bool:
        """Hand a message to the output thread, waiting while it is behind (back-pressure);
        False once it has stopped (the front is gone)."""
        while not self.stop.is_set():
            try:
                self.outputs.put(msg, timeout=1.0)
                return True
            except queue.Full:
                continue
        return False

    def _apply_inputs(self, out: StepOutput, block: bool) -> bool | None:
        """Every input queued; waits (a second at most) for one when the core is idle. Whether
        any came; None when the front asked the core to shut down."""
        messages = []
        try:
            messages.append(self.inputs.get(timeout=1.0) if block else self.inputs.get_nowait())
            while True:
                messages.append(self.inputs.get_nowait())
        except queue.Empty:
            pass
        core = self.core
        for msg in messages:
            if msg is None:
                return None
            for group in msg.adds:
                try:
                    core.add_requests(group)
                except Exception as exc:  # the front checked it; its request alone fails
                    for request in group:
                        out.failed[request.request_id] = one_line(exc)
            if msg.aborts:
                core.abort_requests(msg.aborts)
            if msg.stopped:
                from pagedserve.scheduler import RequestStatus

                core.abort_requests(msg.stopped, RequestStatus.FINISHED_STOPPED)
            for call_id, name in msg.utility:
                try:
                    out.utility.append((call_id, True, core.call_utility(name)))
                except Exception as exc:
                    out.utility.append((call_id, False, one_line(exc)))
            if msg.shutdown:
                return None
        return bool(messages)

    def _read_inputs(self, ctx: Any) -> None:
        import zmq

        sock = ctx.socket(zmq.PULL)
        sock.connect(self.input_addr)
        dec = decoder(CoreInput)
        try:
            while not self.stop.is_set():
                if sock.poll(200):
                    with specs_parsed_by_sender():  # the front parsed them
                        self.inputs.put(dec.decode(sock.recv(copy=False).buffer))
        except Exception:  # a broken message is a bug of ours: end the core loudly
            logger.exception("engine core input thread failed")
            self.inputs.put(None)
        finally:
            sock.close(linger=0)

    def _write_outputs(self, ctx: Any) -> None:
        import zmq

        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, SOCKET_HWM)
        sock.connect(self.output_addr)
        enc = encoder()
        try:
            while True:
                msg = self.outputs.get()
                if msg is None:
                    break
                data = enc.encode(msg)
                # Blocks while the front is SOCKET_HWM messages behind: back-pressure.
                while not sock.poll(1000, zmq.POLLOUT):
                    if os.getppid() != self.parent_pid:
                        logger.warning("the front process is gone: the engine core exits")
                        self.stop.set()
                        return
                sock.send(data, copy=False)
        finally:
            # An error message still goes out (a short linger) before the process exits.
            sock.close(linger=2000)
