"""The API process's side of the engine-core process: start it, then use it like an AsyncEngine.

`EngineProcess.start(args)` spawns `python -m kvrelay.engine.core.process` and returns once the
model is loaded (or raises SystemExit with the child's one-line error), before the HTTP port opens.
`EngineCoreClient(process)` offers AsyncEngine's request API (generate, abort, stats,
default_sampling_params, is_running, shutdown) over the sockets. Closing a generate() iterator early
sends "cancel" at once, so a client that disconnects frees its KV blocks in the engine's next step.
If the process dies, every open stream raises EngineDeadError and `serve` exits non-zero (it
watches the process like its other local workers).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import zmq
from kvrelay.engine.core.process import READY_LINE
from kvrelay.engine.core.protocol import EngineInfo, decode, encode
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.errors import EngineDeadError, InvalidRequestError
from kvrelay.engine.outputs import EngineStats, RequestOutput
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.kvtransfer.worker_base import PARENT_PID_ENV


class EngineProcess:
    """The child process and its socket directory."""

    def __init__(self, proc: subprocess.Popen, directory: Path, args: EngineArgs):
        self.proc = proc
        self.directory = directory
        self.args = args

    @classmethod
    def start(cls, args: EngineArgs, log_level: str = "info", watchdog=None, log_format: str = "text") -> EngineProcess:
        """watchdog: a kvrelay.kvtransfer.watchdog.WatchdogConfig for the step loop (None: its defaults)."""
        directory = Path(tempfile.mkdtemp(prefix="kvrelay-engine-"))  # mode 0700: only this user
        (directory / "args.pkl").write_bytes(pickle.dumps(args))
        if watchdog is not None:
            (directory / "watchdog.pkl").write_bytes(pickle.dumps(watchdog))
        env = os.environ | {PARENT_PID_ENV: str(os.getpid()), "KVRELAY_LOG_LEVEL": log_level,
                              "KVRELAY_LOG_FORMAT": log_format}
        proc = subprocess.Popen([sys.executable, "-m", "kvrelay.engine.core.process", str(directory)],
                                stdout=subprocess.PIPE, text=True, env=env)
        for line in proc.stdout:
            if line.startswith(READY_LINE):
                threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining it
                return cls(proc, directory, args)
            sys.stdout.write(line)
        code = proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
        raise SystemExit(code or 1)  # the child printed its one-line reason on stderr

    def wait(self) -> int:
        """Blocks until the process exits (serve's watcher thread calls this)."""
        return self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


class EngineCoreClient:
    def __init__(self, process: EngineProcess):
        self.process = process
        self.tokenizer = Tokenizer(Path(process.args.model))
        self.model_name = process.args.served_model_name or Path(process.args.model).name
        self.max_model_len = 0
        self.pooler = None
        self._info: EngineInfo | None = None
        self._stats: EngineStats | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._lora_ops: dict[str, asyncio.Future] = {}  # LoRA loads and unloads awaiting the engine
        self._dead: BaseException | None = None
        self.unhealthy: str | None = None  # the engine process's watchdog finds its step loop hung: why
        self._loop: asyncio.AbstractEventLoop | None = None  # set while the inbox is read
        self._ready: asyncio.Future | None = None
        # Read through the event loop's own poller (add_reader on the socket's FD, then drain it):
        # zmq.asyncio's futures and flag enums cost about a third of the API process's CPU per
        # streamed token (benchmarks/gateway_cpu.py --profile).
        self._inbox = zmq.Context.instance().socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        # A plain (blocking-API) socket for sending: with no high-water mark a send only queues, so
        # it can run anywhere, including an async generator's finally during garbage collection.
        self._outbox = zmq.Context.instance().socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.SNDHWM, 0)
        self._outbox.setsockopt(zmq.LINGER, 0)

    async def start(self) -> None:
        d = self.process.directory
        self._inbox.connect(f"ipc://{d}/out")
        self._outbox.connect(f"ipc://{d}/in")
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._loop.add_reader(self._inbox.getsockopt(zmq.FD), self._drain)
        self._drain()  # what arrived before the reader was registered
        info = await self._ready
        self._info = info
        self.model_name, self.max_model_len = info.model_name, info.max_model_len
        self.pooler = info.pooler
        threading.Thread(target=self._watch, args=(asyncio.get_running_loop(),), daemon=True).start()

    @property
    def is_running(self) -> bool:
        return self._ready is not None and self._ready.done() and self._dead is None

    def default_sampling_params(self) -> SamplingParams:
        return self._info.default_sampling_params

    def stats(self) -> EngineStats | None:
        """As of the engine's last report (it reports changes every STATS_INTERVAL_S)."""
        return self._stats

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate: increments until all n samples finished; bad input raises first."""
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", field="request_id")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt, params, priority, cache_salt))
        remaining, finished_ok = params.n, False
        try:
            while remaining:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield item
            finished_ok = True
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished_ok and self._dead is None:
                self._send(("cancel", request_id))

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def shutdown(self) -> None:
        if self.process.proc.poll() is None:
            self._send(("shutdown",))
            try:
                await asyncio.to_thread(self.process.proc.wait, 10)
            except subprocess.TimeoutExpired:
                pass
        self.process.stop()
        if self._loop is not None:
            self._loop.remove_reader(self._inbox.getsockopt(zmq.FD))
            self._loop = None
        self._inbox.close()
        self._outbox.close()

    async def load_lora(self, name: str, path: str) -> None:
        """As AsyncEngine.load_lora, in the engine process; raises LoRAUpdateError."""
        await self._lora("load", name, path)

    async def unload_lora(self, name: str) -> None:
        await self._lora("unload", name, None)

    async def _lora(self, op: str, name: str, path: str | None) -> None:
        from kvrelay.engine.lora.runtime import LoRAUpdateError

        op_id = uuid.uuid4().hex
        fut = self._lora_ops[op_id] = self._loop.create_future()
        self._send(("lora", op_id, op, name, path))
        error = await fut
        if error is not None:
            raise LoRAUpdateError(error[1], error[0])

    def _send(self, message: tuple) -> None:
        self._outbox.send(encode(message))

    def _drain(self) -> None:
        """Every message waiting in the inbox. The socket's FD only signals that its state changed,
        so each wake-up reads until nothing is left."""
        while self._loop is not None:
            try:
                raw = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(decode(raw))

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if not self._ready.done():
            if kind == "ready":
                self._ready.set_result(msg[1])
            else:
                self._ready.set_exception(EngineDeadError(f"the engine process sent {kind!r} before it was "
                                                          f"ready: {msg[1:]}"))
        elif kind == "outs":
            for out in msg[1]:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)
        elif kind == "stats":
            self._stats = msg[1]
        elif kind == "error":
            stream = self._streams.get(msg[1])
            if stream is not None:
                stream.put_nowait(msg[2])
        elif kind == "lora_done":
            fut = self._lora_ops.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_result(msg[2])
        elif kind == "health":
            self.unhealthy = msg[1]
        elif kind == "fatal":
            self._fail(EngineDeadError(msg[1]))

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        code = self.process.proc.wait()
        try:
            loop.call_soon_threadsafe(self._fail, EngineDeadError(f"the engine process exited with code {code}"))
        except RuntimeError:  # the loop closed first: serve is stopping anyway
            pass

    def _fail(self, error: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = error
        for stream in self._streams.values():
            stream.put_nowait(error)
        for fut in self._lora_ops.values():
            if not fut.done():
                fut.set_exception(error)
