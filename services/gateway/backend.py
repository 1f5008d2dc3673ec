"""The seam between the gateway and whatever generates tokens.

A backend is an object with the AsyncEngine's request API:

    model_name: str, max_model_len: int, tokenizer, role: str, capacity: int
    generate(prompt, params, request_id, priority=0) -> async iterator of RequestOutput
    abort(request_id), stats() -> EngineStats | None, ready() -> bool,
    default_sampling_params() -> SamplingParams, start(), shutdown()

`generate` raises InvalidRequestError / PromptTooLongError before scheduling for bad input,
yields increments until all `n` samples finish, and ends with finish_reason "abort" after
`abort`; closing the iterator (aclose) aborts too and frees the request's KV blocks.
`capacity` is how many sequences the backend runs at once: past it the gateway queues.

Implementations:
- `LocalBackend`: an AsyncEngine in this process, or, given an EngineProcess (`kvrelay serve`),
  the same API through `kvrelay.engine.core.client` to the engine running in a process of its own.
- `DisaggregatedBackend` (`kvrelay.gateway.disaggregated`; `kvrelay gateway`,
  `kvrelay serve --disaggregated`): routes each request to prefill workers (prefix affinity +
  load) and a decode worker (load) chosen by `kvrelay.gateway.routing`, through the workers'
  gRPC client in `kvrelay.kvtransfer`, and retries a decode worker that fails before the
  first token on another one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from kvrelay.engine.outputs import EngineStats, RequestOutput
from kvrelay.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 64
# The engine's step thread and the event loop share the GIL. At Python's default 5 ms switch
# interval every wake-up of the loop (a new connection, a token to forward) can wait up to 5 ms
# behind a step. The step's heavy work runs in torch with the GIL released, so a 0.1 ms
# interval costs the engine little and keeps the gateway's added latency low
# (benchmarks/gateway.py: added e2e p50 went from ~8 ms at 0.5 ms to ~4.5 ms at 0.1 ms).
GIL_SWITCH_INTERVAL_S = 0.0001


class Backend(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: Any
    roles: tuple[str, ...]  # role labels of the queue-depth metric: ("engine",) or ("prefill", "decode")
    capacity: int
    lora_modules: dict[str, Path]  # the LoRA adapters served, by name (kvrelay.engine.lora)
    model_aliases: tuple[str, ...]  # more names of the model (--served-model-name NAME ALIAS...)

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                 priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]: ...
    async def abort(self, request_id: str) -> None: ...
    def stats(self) -> EngineStats | None: ...
    def ready(self) -> bool: ...
    def default_sampling_params(self) -> SamplingParams: ...
    async def start(self) -> None: ...
    async def shutdown(self) -> None: ...


class LocalBackend:
    """An AsyncEngine in this process, or the client of an engine-core process. The engine (or the
    client) is built in `start()`, inside the loop."""

    roles = ("engine",)

    def __init__(self, engine_args, process=None, watchdog=None, stats_interval_s: float = 10.0):
        self.engine_args = engine_args
        self.process = process  # kvrelay.engine.core.client.EngineProcess, or None: in this process
        self.engine = None
        self._started = False
        self.on_dead = None  # fn(error), called once if the engine's step loop crashes (serve exits)
        # In this process: its step-loop watchdog (kvrelay.kvtransfer.watchdog.WatchdogConfig; None:
        # the defaults). The engine-core process runs its own and reports its verdict.
        self.watchdog_config = watchdog
        self.watchdog = None
        self.stats_interval_s = stats_interval_s
        self.stats_logger = None

    async def start(self) -> None:
        if self.process is not None:
            from kvrelay.engine.core.client import EngineCoreClient

            self.engine = EngineCoreClient(self.process)
        else:
            import os

            from kvrelay.engine.async_engine import AsyncEngine
            from kvrelay.kvtransfer.watchdog import HANG_AFTER_STEPS_ENV, install_hang_hook

            sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
            self.engine = AsyncEngine(self.engine_args)
            hang = os.environ.get(HANG_AFTER_STEPS_ENV)
            install_hang_hook(self.engine, int(hang) if hang else None)
        await self.engine.start()
        await asyncio.to_thread(lambda: self.images)  # a vision model's image processor, off the event loop
        if self.process is None:
            from kvrelay.kvtransfer.watchdog import Watchdog

            self.watchdog = Watchdog(self.engine, self.watchdog_config, "serve")
            self.watchdog.start()
        from kvrelay.engine.stats_logger import StatsLogger

        self.stats_logger = StatsLogger(self.engine.stats, self.stats_interval_s, "serve engine")
        self.stats_logger.start()
        self._started = True
        if self.process is None:  # an engine-core process is watched as a process by serve
            self._dead_watch = asyncio.create_task(self._watch_dead())

    async def _watch_dead(self) -> None:
        error = await self.engine.wait_dead()
        if self.on_dead is not None:
            self.on_dead(error)

    def alive(self) -> bool:
        """False while a watchdog (this process's, or the engine-core process's) finds the engine's
        step loop hung (liveness)."""
        if self.watchdog is not None and not self.watchdog.healthy:
            return False
        return not getattr(self.engine, "unhealthy", None)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def pooler(self):
        """A pooling engine's PoolerConfig (task embed or classify, the labels); None when it generates."""
        return self.engine.pooler

    @property
    def model_aliases(self) -> tuple[str, ...]:
        return tuple(getattr(self.engine_args, "served_model_aliases", ()))

    @functools.cached_property
    def images(self):
        """A vision-language model's ImageProcessor (kvrelay.gateway.images); None for a text-only model."""
        from kvrelay.gateway.images import ImageProcessor

        return ImageProcessor.for_model(Path(self.engine_args.model))

    @functools.cached_property
    def lora_modules(self) -> dict[str, Path]:
        from kvrelay.engine.lora.adapter import parse_lora_modules

        return parse_lora_modules(getattr(self.engine_args, "lora_modules", None) or [])

    async def load_lora(self, name: str, path: str) -> None:
        """A LoRA adapter loaded at run time (kvrelay.engine.lora.runtime); LoRAUpdateError if not."""
        await self.engine.load_lora(name, path)
        self.lora_modules[name] = Path(path)

    async def unload_lora(self, name: str) -> None:
        await self.engine.unload_lora(name)
        self.lora_modules.pop(name, None)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def capacity(self) -> int:
        return getattr(self.engine_args, "max_num_seqs", None) or DEFAULT_CAPACITY

    def generate(self, prompt, params, request_id, priority=0, cache_salt=None):
        return self.engine.generate(prompt, params, request_id, priority=priority, cache_salt=cache_salt)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    def ready(self) -> bool:
        if not self._started or self.engine is None:
            return False
        return bool(getattr(self.engine, "is_running", True)) and self.alive()

    def default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    async def shutdown(self) -> None:
        if self.stats_logger is not None:
            await self.stats_logger.stop()
        if self.watchdog is not None:
            await self.watchdog.stop()
        if self.engine is not None:
            await self.engine.shutdown()
