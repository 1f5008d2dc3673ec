"""The backend over prefill and decode workers (`kvrelay gateway`, `kvrelay serve --disaggregated`).

For each request: pick a decode worker by prefix affinity and load, pick prefill workers by
prefix affinity, the decode worker's node (when it offers shared memory) and load
(`routing.WorkerPool`), and call the decode worker's Generate with that prefill list (the
decode worker pulls the KV from the first prefill worker that succeeds). A decode worker that
fails before the first token (unreachable, no capacity) is retried on another one.

Each worker's load stream (`kvrelay.kvtransfer.client.watch_load`) feeds the pools; a broken
stream ejects the worker at once, a silent one after `eject_after_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path

from kvrelay.engine.block_pool import cache_root, prompt_block_hashes
from kvrelay.engine.outputs import EngineStats
from kvrelay.engine.sampling_params import SamplingParams, defaults_from_generation_config
from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.gateway import deadlines
from kvrelay.gateway.access_log import REQUEST_ID
from kvrelay.gateway.breaker import BreakerConfig, Breakers
from kvrelay.gateway.routing import Discovery, WorkerPool
from kvrelay.gateway.routing_policy import resolve as resolve_policy
from kvrelay.gateway.stall import StallConfig, StalledError, StepTimes, watch

log = logging.getLogger(__name__)

MAX_AFFINITY_BLOCKS = 64  # leading blocks hashed for prefix affinity (prefill and decode)
PREFILL_CANDIDATES = 2  # prefill workers the decode worker may try, in order
DECODE_ATTEMPTS = 3


class DisaggregatedBackend:
    roles = ("prefill", "decode")

    def __init__(self, prefill: str, decode: str, model: str, served_model_name: str | None = None,
                 capacity: int = 256, dns_refresh_s: float = 5.0, eject_after_s: float = 1.0,
                 load_interval_s: float = 0.2, routing_policy: str | None = None,
                 stall: StallConfig | None = None, breaker: BreakerConfig | None = None,
                 max_message_bytes: int | None = None, lora_modules: dict[str, Path] | None = None,
                 model_aliases: tuple[str, ...] = ()):
        """max_message_bytes: the largest gRPC message read from or sent to a decode worker (the workers'
        --max-message-bytes; None: the default, 4 MiB). lora_modules: the workers' LoRA adapters by name."""
        from kvrelay.kvtransfer import client  # noqa: F401 - fail early if the workers' client is missing
        from kvrelay.kvtransfer.layout import DEFAULT_MAX_MESSAGE_BYTES

        self.max_message_bytes = max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES

        self.model_dir = Path(model)
        self.tokenizer = Tokenizer(self.model_dir)
        self._served_model_name = served_model_name
        self.lora_modules = lora_modules or {}
        self.model_aliases = model_aliases
        self._reported_model_id: str | None = None
        self.capacity = capacity
        self.load_interval_s = load_interval_s
        policy = resolve_policy(routing_policy)  # raises ValueError naming the loaded ones
        self.prefill = WorkerPool("prefill", eject_after_s, policy=policy)
        self.decode = WorkerPool("decode", eject_after_s, policy=policy)
        self._discovery = [Discovery(self.prefill, prefill, dns_refresh_s),
                           Discovery(self.decode, decode, dns_refresh_s)]
        config = _read_json(self.model_dir / "config.json")
        self._config_max_len = int(config.get("max_position_embeddings", 2048))
        self._reported_max_len: int | None = None
        self._block_size = 16
        self._generation_config = _read_json(self.model_dir / "generation_config.json")
        self._watchers: dict[tuple[str, str], asyncio.Task] = {}
        self._clients: dict[str, object] = {}
        self._where: dict[str, str] = {}  # request id -> decode worker serving it
        self._supervisor: asyncio.Task | None = None
        self.retries = 0  # requests moved to another decode worker after a failure before the first token
        self.step_times = StepTimes(stall or StallConfig())
        self.breakers = Breakers(breaker)
        self._draining: set[str] = set()  # workers finishing their streams before they stop
        self._down: set[tuple[str, str]] = set()  # (role, address) whose load stream is broken: logged once

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        for d in self._discovery:
            await d.start()
        self._supervise_once()
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def shutdown(self) -> None:
        for d in self._discovery:
            await d.stop()
        tasks = [t for t in [self._supervisor, *self._watchers.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in self._clients.values():
            await c.close()

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            self._supervise_once()

    def _supervise_once(self) -> None:
        """One load watcher per current member; watchers of members that left are stopped."""
        wanted = {(pool.role, a) for pool in (self.prefill, self.decode) for a in pool.workers}
        for key in set(self._watchers) - wanted:
            self._watchers.pop(key).cancel()
        for role, address in wanted - set(self._watchers):
            pool = self.prefill if role == "prefill" else self.decode
            self._watchers[(role, address)] = asyncio.get_running_loop().create_task(self._watch(pool, address))

    async def _watch(self, pool: WorkerPool, address: str) -> None:
        from kvrelay.kvtransfer.client import watch_load

        while address in pool.workers:
            try:
                async for r in watch_load(address, self.load_interval_s):
                    if (pool.role, address) in self._down:
                        self._down.discard((pool.role, address))
                        log.info("%s worker %s: load stream back", pool.role, address)
                    self._draining.discard(address)
                    pool.report(address, num_waiting=r.num_waiting, num_running=r.num_running,
                                kv_blocks_free=r.kv_blocks_free, kv_blocks_total=r.kv_blocks_total,
                                cached_blocks=r.prefix_hashes_current, node=r.node, kv_shm=r.kv_shm)
                    self._reported_max_len = r.max_model_len
                    self._reported_model_id = r.layout.model_id
                    self._block_size = r.layout.block_size
                    if r.draining:
                        self._draining.add(address)  # its streams in flight finish: not a stall
                        break
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any broken stream means: not usable now
                if (pool.role, address) not in self._down:  # once per outage, not every retry
                    self._down.add((pool.role, address))
                    log.warning("%s worker %s ejected: %s", pool.role, address, e)
            worker = pool.workers.get(address)
            if worker is not None:
                worker.last_report = 0.0  # ejected until its stream is back
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ the backend API

    @property
    def model_name(self) -> str:
        """--served-model-name, else the id the workers serve, else the model folder's name."""
        return self._served_model_name or self._reported_model_id or self.model_dir.name

    @property
    def max_model_len(self) -> int:
        return self._reported_max_len or self._config_max_len

    def ready(self) -> bool:
        return bool(self.decode.live())

    def stats(self) -> EngineStats | None:
        workers = self.decode.live() + self.prefill.live()
        if not workers:
            return None
        return EngineStats(
            num_waiting=sum(w.num_waiting for w in workers), num_running=sum(w.num_running for w in workers),
            kv_blocks_total=sum(w.kv_blocks_total for w in self.decode.live()),
            kv_blocks_free=sum(w.kv_blocks_free for w in self.decode.live()),
            prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
            prompt_tokens_total=0, generation_tokens_total=0)

    def default_sampling_params(self) -> SamplingParams:
        return defaults_from_generation_config(self._generation_config)

    def _client(self, address: str):
        from kvrelay.kvtransfer.client import DecodeClient

        if address not in self._clients:
            self._clients[address] = DecodeClient(address, self.max_message_bytes)
        return self._clients[address]

    async def generate(self, prompt, params: SamplingParams, request_id: str, priority: int = 0,
                       cache_salt: str | None = None):
        from kvrelay.kvtransfer.errors import DeadlineExceededError, NoCapacityError, WorkerUnavailableError

        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode_prompt(prompt)
        # Affinity on the salted keys: the same keys the workers' caches hold and publish.
        hashes = prompt_block_hashes(ids[: MAX_AFFINITY_BLOCKS * self._block_size], self._block_size,
                                     cache_root(cache_salt, params.lora))
        tried: set[str] = set()
        last_error: Exception | None = None
        for _ in range(DECODE_ATTEMPTS):
            decode = self.decode.pick_decode(hashes, exclude=tried | self.breakers.unavailable("decode"))
            if decode is None:
                break
            breaker = self.breakers.get("decode", decode.address)
            breaker.acquire()
            prefills = []
            for _ in range(PREFILL_CANDIDATES):
                p = self.prefill.pick_prefill(hashes, exclude=[w.address for w in prefills],
                                              node=decode.node if decode.kv_shm else "")
                if p is None:
                    break
                prefills.append(p)
            started = False
            decode.inflight += 1
            for p in prefills:
                p.inflight += 1
            self._where[request_id] = decode.address
            stream = self._client(decode.address).generate(
                ids, params, request_id, prefill_addr=[p.address for p in prefills] or None, priority=priority,
                cache_salt=cache_salt, timeout_s=deadlines.remaining(),
                metadata=(("x-request-id", xrid),) if (xrid := REQUEST_ID.get()) else None)
            address = decode.address
            watched = watch(stream, address, lambda a=address: self._alive(a), self.step_times)
            try:
                async for out in watched:
                    if not started:
                        started = True
                        breaker.success()
                        for p in prefills:  # prefill is done once the first token exists
                            p.inflight -= 1
                    yield out
                return
            except StalledError as e:
                breaker.failure(str(e))
                if started:  # tokens reached the caller: a clean error, not a second answer
                    raise WorkerUnavailableError(f"decode worker {address} stalled mid-stream: {e}") from None
                log.warning("request %s: %s before the first token; retrying elsewhere", request_id, e)
                tried.add(address)
                self.retries += 1
                last_error = WorkerUnavailableError(str(e))
            except (WorkerUnavailableError, NoCapacityError) as e:
                if isinstance(e, WorkerUnavailableError):
                    breaker.failure(str(e))
                if started:
                    raise
                log.warning("decode worker %s failed before the first token, retrying elsewhere: %s", address, e)
                tried.add(address)
                self.retries += 1
                last_error = e
            except DeadlineExceededError:
                breaker.failure("deadline exceeded")
                raise
            finally:
                breaker.release()
                decode.inflight -= 1
                if not started:
                    for p in prefills:
                        p.inflight -= 1
                self._where.pop(request_id, None)
                # A stalled read is still closing the stream in the background (RuntimeError here).
                for gen in (watched, stream):
                    with contextlib.suppress(RuntimeError):
                        await gen.aclose()
        raise last_error or WorkerUnavailableError("no live decode worker")

    def _alive(self, address: str) -> bool:
        """Whether a decode worker still proves it is alive (or is draining its streams)."""
        return address in self._draining or any(w.address == address for w in self.decode.live())

    def metric_collectors(self) -> list:
        return [self.breakers]

    async def abort(self, request_id: str) -> None:
        address = self._where.get(request_id)
        if address is not None:
            await self._client(address).abort(request_id)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
