"""Async front of the engine: submit requests, iterate their outputs, abort them, read stats.

One background thread runs LLMEngine.step() in a loop. Requests and aborts are queued to
that thread and applied between steps; outputs go back to each request's asyncio.Queue on
the event loop. Torch releases the GIL during the forward pass, so the loop stays responsive.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.errors import EngineDeadError, InvalidRequestError
from kvrelay.engine.handoff import PrefixChangedError, Reservation
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.engine.outputs import EngineStats, RequestOutput, TokenLogprob
from kvrelay.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, args: EngineArgs | None = None, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(args or EngineArgs())
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.pooler = self.engine.pooler  # pooling: kvrelay.engine.pooling.config.PoolerConfig
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._died: asyncio.Event | None = None  # set on the loop once the step loop crashed
        self._stats = self.engine.stats()
        # Called on the engine thread with each step's outputs before they go to the loop (the
        # prefill worker rings the doorbell there); must not raise.
        self.after_step: Callable[[list[RequestOutput]], None] | None = None
        # Called on the engine thread before each step (tests make the step loop hang with it).
        self.before_step: Callable[[], None] | None = None
        # The step loop's liveness, read by kvrelay.kvtransfer.watchdog: when it last went round
        # (an idle loop goes round every 0.5 s) and the mean duration of a step.
        self.heartbeat = time.monotonic()
        self.mean_step_s = 0.0

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._died = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="kvrelay-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None
        if hasattr(self.engine, "close"):  # parallel worker processes, if any
            self.engine.close()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._dead is None

    async def wait_dead(self) -> BaseException:
        """The error that stopped the step loop, once it has (waits forever while it runs)."""
        if self._died is None:
            await self.start()
        await self._died.wait()
        return self._dead

    def call_in_engine_thread(self, fn: Callable[[LLMEngine], object]) -> asyncio.Future:
        """Run fn(engine) on the engine thread between steps; await the returned future for its result."""
        fut = self._loop.create_future()
        self._commands.put(("call", (fn, fut)))
        self._wake.set()
        return fut

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at path as name from the next step on (kvrelay.engine.lora.runtime):
        read and checked off the engine thread. Raises LoRAUpdateError or ModelLoadError."""
        from kvrelay.engine.lora.adapter import load_adapter
        from kvrelay.engine.lora.runtime import add_adapter

        e = self.engine
        adapter = await asyncio.to_thread(load_adapter, name, Path(path), e.config, e.args.max_lora_rank, e.dtype)
        await self.call_in_engine_thread(lambda engine: add_adapter(engine, adapter))

    async def unload_lora(self, name: str) -> None:
        from kvrelay.engine.lora.runtime import remove_adapter

        await self.call_in_engine_thread(lambda engine: remove_adapter(engine, name))

    # ---- requests ---------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        hold_blocks: bool = False,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield increments until all n samples finished. Bad input raises before scheduling.

        Closing the iterator early (client gone, task cancelled) aborts the request and frees
        its KV blocks. hold_blocks, cache_salt: see LLMEngine.make_request.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._dead!r}")
        if self._thread is None:
            await self.start()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", field="request_id")
        await self._compile(params)
        # Validation and tokenization touch no shared engine state: do them here, raising to the caller.
        seqs = self.engine.make_request(prompt, params, request_id, priority, hold_blocks, cache_salt)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put(("add", (seqs, stream)))
        self._wake.set()
        remaining = params.n
        finished_ok = False
        try:
            while remaining:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped after an error: {item!r}") from item
                if item.finished:
                    remaining -= 1
                yield item
            finished_ok = True
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished_ok:
                # Abort these very sequences: a new request that reuses the id must not be hit.
                self._commands.put(("drop_seqs", seqs))
                self._wake.set()

    async def generate_prefilled(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int,
        load_kv: Callable[[Reservation], Awaitable[tuple[int, TokenLogprob | None]]],
        cache_salt: str | None = None,
        early_start: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Decode side of a prefill/decode hand-off; yields like generate() (one sample).

        Reserves blocks for the prompt (raises NoFreeBlocksError if they do not fit now: reject,
        never wait), awaits load_kv(reservation), which fills reservation.block_ids after the
        first num_cached_blocks (prefix-cache hits, already holding their K/V) and returns
        (first_token, first_logprob), then yields the first token's output at once
        (LLMEngine.settle_first_token) while the engine thread schedules the sequence (yields
        nothing if abort() came first). load_kv must write only through LLMEngine.write_reserved (from the engine thread
        or any other): a failure or early close queues the abort, which waits for a write in
        progress and stops later ones, so the blocks are never freed under a copy.

        early_start: load_kv starts at once, while the engine thread reserves (which waits for
        the step in flight), with num_cached_blocks from a probe of the prefix cache; it must
        await the reservation (Reservation.wait / wait_blocking) before it writes. If the probed
        blocks are evicted before the reservation, the attempt starts over without early start.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._dead!r}")
        if self._thread is None:
            await self.start()
        if request_id in self._streams:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", field="request_id")
        await self._compile(params)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        finished_ok = reserve_failed = False
        # Prompt logprobs salt the request's cache root at random: a probe could never match it.
        early_start = early_start and params.prompt_logprobs is None
        try:
            while True:
                try:
                    first_token, first_logprob = await self._reserve_and_load(
                        prompt_ids, params, request_id, priority, load_kv, cache_salt, early_start)
                    break
                except PrefixChangedError:
                    log.debug("prefix-cache blocks of %s were evicted before its reservation: starting over "
                              "without early start", request_id)
                    early_start = False
                except _ReserveFailed as e:
                    reserve_failed = True  # nothing allocated; the id may belong to someone else
                    raise e.__cause__ from None

            # The first token's output is made here, not on the engine thread, which would make it
            # wait for the step in flight; the engine thread then only schedules the sequence.
            first = self.engine.settle_first_token(request_id, first_token, first_logprob)
            if first is None:  # abort() came first and freed the blocks while the K/V loaded
                finished_ok = True
                return
            activated = self.call_in_engine_thread(lambda llm: llm.activate(request_id))  # queued before the yield
            yield first
            if await activated and not first.finished:
                while True:
                    item = await stream.get()
                    if isinstance(item, BaseException):
                        raise EngineDeadError(f"the engine stopped after an error: {item!r}") from item
                    yield item
                    if item.finished:
                        break
            finished_ok = True
        finally:
            self._streams.pop(request_id, None)
            if not finished_ok and not reserve_failed:
                # "drop": nobody reads this attempt's abort output, and it must not reach a stream
                # that reuses the id (a retry on another prefill worker, or a local prefill).
                self._commands.put(("drop", request_id))
                self._wake.set()

    async def _reserve_and_load(self, prompt_ids, params, request_id, priority, load_kv, cache_salt,
                                early_start: bool) -> tuple[int, TokenLogprob | None]:
        """One reservation and its load_kv, started together when early_start. Raises
        PrefixChangedError (nothing reserved, the load given up) for the caller to start over, and
        _ReserveFailed from any other reservation error."""
        probed = None
        loading: asyncio.Future | None = None
        res = None
        num_blocks = -(-len(prompt_ids) // self.engine.args.block_size)
        if early_start:
            probed = self.engine.probe_cached_blocks(prompt_ids, cache_salt, params.lora)
            # A pool that cannot hold the prompt now is told by the reservation, before any prefill
            # starts (read off the engine thread: a hint, which a reservation failing later overrides).
            if self.engine.pool.num_free < num_blocks - probed:
                probed = None
        if probed is not None:
            res = Reservation(num_blocks, probed)
            loading = asyncio.ensure_future(load_kv(res))

        def reserve(llm):
            seq = llm.reserve(prompt_ids, params, request_id, priority, cache_salt, max_cached_blocks=probed)
            return list(seq.block_table), seq.num_registered

        try:
            try:
                block_ids, num_cached = await self.call_in_engine_thread(reserve)
            except Exception as e:
                if res is not None:
                    res.fail(e)
                if isinstance(e, PrefixChangedError):
                    raise
                raise _ReserveFailed from e
            if res is None:
                return await load_kv(Reservation.reserved(block_ids, num_cached))
            res.fill(block_ids)
            return await loading
        finally:
            if res is not None and not res.done:  # settled before the load is cancelled: a thread may wait on it
                res.fail(RuntimeError(f"the reservation of {request_id!r} was given up"))
            if loading is not None and not loading.done():
                loading.cancel()
                await asyncio.gather(loading, return_exceptions=True)

    async def _compile(self, params: SamplingParams) -> None:
        """Compile (or find cached) the request's grammar in a worker thread: never on the engine
        thread, where it would stall a step, nor on the event loop."""
        if params.structured is not None:
            await asyncio.to_thread(self.engine.grammars.get, params.structured)

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        """Stats as of the last step (read without locking the engine thread)."""
        return self._stats

    # ---- engine thread ------------------------------------------------------------------------

    def _apply_commands(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "add":
                seqs, stream = arg
                if self._streams.get(seqs[0].request_id) is stream:  # still wanted by its caller
                    self.engine.add(seqs)
            elif kind == "drop_seqs":
                if self.engine.requests.get(arg[0].request_id) is arg:
                    self.engine.abort(arg[0].request_id)
            elif kind == "abort":
                outputs.extend(self.engine.abort(arg))
            elif kind == "drop":  # abort whose outputs nobody reads
                self.engine.abort(arg)
            elif kind == "call":
                fn, fut = arg
                try:
                    result = fn(self.engine)
                except Exception as e:  # noqa: BLE001 - handed to the awaiting caller
                    self._loop.call_soon_threadsafe(_set_exception, fut, e)
                else:
                    self._loop.call_soon_threadsafe(_set_result, fut, result)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self.heartbeat = time.monotonic()
                outputs = self._apply_commands()
                if self.engine.has_work():
                    if self.before_step is not None:
                        self.before_step()
                    started = time.monotonic()
                    stepped = self.engine.step()
                    self.mean_step_s += 0.05 * (time.monotonic() - started - self.mean_step_s)
                    if self.after_step is not None:
                        self.after_step(stepped)
                    outputs.extend(stepped)
                self._stats = self.engine.stats()
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
                if not self.engine.has_work() and self._commands.empty():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as e:
            log.exception("engine step loop crashed")
            self._dead = e
            self._loop.call_soon_threadsafe(self._fail_all, e)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)
        self._died.set()


class _ReserveFailed(Exception):
    """Wraps (as __cause__) an error of the reservation itself, as opposed to one of load_kv."""


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
