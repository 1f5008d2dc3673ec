"""The engine-core process: an AsyncEngine behind two ZeroMQ sockets, started by `kvrelay serve`.

Running the step loop apart from the HTTP server means the two no longer share one GIL: the API
process parses requests, renders templates and streams tokens while this one only steps.
    python -m kvrelay.engine.core.process DIR
DIR (made by the parent, mode 0700) holds args.pkl, the EngineArgs; this process binds DIR/in and
DIR/out, prints READY_LINE on stdout once the model is loaded, and exits with the parent
(PR_SET_PDEATHSIG), on ("shutdown",), on SIGTERM (not SIGINT: the parent handles Ctrl+C), or with code 1 when the step loop dies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import sys
from pathlib import Path

import zmq
import zmq.asyncio
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.core.protocol import STATS_INTERVAL_S, EngineInfo, decode, encode, picklable_stats
from kvrelay.engine.errors import EngineError
from kvrelay.kvtransfer.watchdog import HANG_AFTER_STEPS_ENV, Watchdog, WatchdogConfig, install_hang_hook
from kvrelay.kvtransfer.worker_base import _stop_with_parent

from kvrelay.log_format import setup_logging

log = logging.getLogger(__name__)
READY_LINE = "kvrelay engine-core ready"


class EngineCoreServer:
    def __init__(self, engine: AsyncEngine, directory: Path, watchdog: WatchdogConfig | None = None):
        self.engine = engine
        self.watchdog = Watchdog(engine, watchdog, "serve engine")
        self.ctx = zmq.asyncio.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(f"ipc://{directory}/in")
        self.outbox = zmq.Context.instance().socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.SNDHWM, 0)  # never block the loop: the API process reads all of it
        self.outbox.setsockopt(zmq.LINGER, 2000)
        self.outbox.bind(f"ipc://{directory}/out")
        self.tasks: dict[str, asyncio.Task] = {}
        self._pending: list = []  # RequestOutputs to send in the next flush

    async def run(self) -> int:
        await self.engine.start()
        e = self.engine
        info = EngineInfo(e.model_name, e.max_model_len, e.default_sampling_params(), os.getpid(), e.pooler)
        self.outbox.send(encode(("ready", info)))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        receiver = asyncio.create_task(self._receive(stop))
        stats = asyncio.create_task(self._send_stats())
        died = asyncio.create_task(self.engine.wait_dead())
        stopped = asyncio.create_task(stop.wait())
        self.watchdog.start()
        health = asyncio.create_task(self._send_health())
        hung = asyncio.create_task(self.watchdog.expired.wait())
        await asyncio.wait([died, stopped, receiver, hung], return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if died.done():
            self.outbox.send(encode(("fatal", f"the engine stopped after an error: {died.result()!r}")))
            code = 1
        for task in (receiver, stats, died, stopped, health, hung, *self.tasks.values()):
            task.cancel()
        await self.watchdog.stop()
        if hung.done():  # the engine thread is stuck: shutdown() would wait for it in vain
            self.outbox.send(encode(("fatal", f"the engine's step loop hung: {self.watchdog.reason}")))
            self.outbox.close()
            os._exit(1)
        await self.engine.shutdown()
        self.outbox.close()
        self.inbox.close()
        return code

    async def _receive(self, stop: asyncio.Event) -> None:
        while True:
            msg = decode(await self.inbox.recv())
            kind = msg[0]
            if kind == "add":
                _, rid, prompt, params, priority, salt = msg
                self.tasks[rid] = asyncio.create_task(self._generate(rid, prompt, params, priority, salt))
            elif kind == "abort":
                await self.engine.abort(msg[1])
            elif kind == "cancel":
                task = self.tasks.pop(msg[1], None)
                if task is not None:  # closing its generator frees the blocks; wait so the id is free again
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            elif kind == "lora":
                asyncio.create_task(self._lora(*msg[1:]))
            elif kind == "shutdown":
                stop.set()
                return

    async def _lora(self, op_id: str, op: str, name: str, path: str | None) -> None:
        from kvrelay.engine.lora.runtime import LoRAUpdateError

        error = None
        try:
            await (self.engine.load_lora(name, path) if op == "load" else self.engine.unload_lora(name))
        except LoRAUpdateError as e:
            error = (e.status, str(e))
        except (EngineError, OSError, ValueError) as e:  # ModelLoadError: a bad adapter folder
            error = (400, str(e))
        self.outbox.send(encode(("lora_done", op_id, error)))

    async def _generate(self, rid: str, prompt, params, priority: int, salt: str | None) -> None:
        try:
            async for out in self.engine.generate(prompt, params, rid, priority, cache_salt=salt):
                self._emit(out)
        except EngineError as e:  # refused before scheduling (bad input), or the engine died
            self._flush()
            self.outbox.send(encode(("error", rid, e)))
        finally:
            if self.tasks.get(rid) is asyncio.current_task():
                del self.tasks[rid]

    def _emit(self, out) -> None:
        # Every request's task wakes in the same loop iteration after a step; the flush scheduled
        # by the first runs after them all, so a step's outputs travel as one message.
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(out)

    def _flush(self) -> None:
        if self._pending:
            outs, self._pending = self._pending, []
            self.outbox.send(encode(("outs", outs)))

    async def _send_health(self) -> None:
        """The watchdog's verdict, sent on change: the API process answers /ready and /health from it."""
        last = ""
        while True:
            if self.watchdog.reason != last:
                last = self.watchdog.reason
                self.outbox.send(encode(("health", last or None)))
            await asyncio.sleep(self.watchdog.config.poll_s)

    async def _send_stats(self) -> None:
        last = None
        while True:
            stats = picklable_stats(self.engine.stats())
            if stats != last:
                self.outbox.send(encode(("stats", stats)))
                last = stats
            await asyncio.sleep(STATS_INTERVAL_S)


def main(argv: list[str] | None = None) -> int:
    directory = Path((argv or sys.argv[1:])[0])
    args = pickle.loads((directory / "args.pkl").read_bytes())  # written by our parent
    setup_logging(os.environ.get("KVRELAY_LOG_LEVEL", "info"), os.environ.get("KVRELAY_LOG_FORMAT", "text"))
    _stop_with_parent()
    # Ctrl+C reaches the whole process group: the API process stops first and then stops this one,
    # so a request in flight still gets its error event, and serve's exit code is its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watchdog_file = directory / "watchdog.pkl"
    watchdog = pickle.loads(watchdog_file.read_bytes()) if watchdog_file.exists() else None
    try:
        engine = AsyncEngine(args)
        hang = os.environ.get(HANG_AFTER_STEPS_ENV)
        install_hang_hook(engine, int(hang) if hang else None)
    except (OSError, ValueError, EngineError) as e:
        print(f"kvrelay serve: the engine could not start: {e}", file=sys.stderr, flush=True)
        return 2

    async def serve() -> int:
        server = EngineCoreServer(engine, directory, watchdog)
        print(READY_LINE, flush=True)
        return await server.run()

    return asyncio.run(serve())


if __name__ == "__main__":
    sys.exit(main())
