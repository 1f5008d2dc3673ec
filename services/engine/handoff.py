"""The engine's side of the prefill/decode hand-off: a prefill worker keeps a finished request's
blocks (hold_blocks) until its K/V has left; a decode worker reserves blocks for a prompt another
worker computed, has the K/V written into them, then activates the sequence as if it had prefilled.

A mixin of LLMEngine, kept apart so the step loop reads in one file and the hand-off in another.

Early start: the decode side may ask the prefill worker to start before its engine thread has
reserved, which otherwise waits for the step in flight. It then needs the number of leading
prefix-cache hits up front: probe_cached_blocks reads it off the engine thread, and
reserve(max_cached_blocks=) holds the reservation to exactly that count (PrefixChangedError if
some of those blocks were evicted in between: the caller starts over without the early start).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.engine.block_pool import NoFreeBlocksError, cache_root, hash_block
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.outputs import RequestOutput
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence, Status


class PrefixChangedError(RuntimeError):
    """The prefix-cache blocks a probe counted were (partly) evicted before the reservation."""


@dataclass(eq=False)
class Reservation:
    """The decode side's blocks for a prompt another worker computes, as its K/V loader sees them.

    num_blocks and num_cached_blocks (leading prefix-cache hits, which already hold their K/V) are
    known at once; block_ids once the engine thread has reserved them. With an early start the
    loader begins before that: it awaits wait() (event loop) or wait_blocking() (other threads)
    before it writes. Settled once, on the event loop, by fill() or fail()."""

    num_blocks: int
    num_cached_blocks: int
    block_ids: list[int] = field(default_factory=list)  # filled in place by fill()
    error: BaseException | None = None
    _event: threading.Event = field(default_factory=threading.Event, repr=False)
    _future: asyncio.Future | None = field(default=None, repr=False)

    @classmethod
    def reserved(cls, block_ids: list[int], num_cached_blocks: int) -> Reservation:
        r = cls(len(block_ids), num_cached_blocks)
        r.fill(block_ids)
        return r

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def fill(self, block_ids: list[int]) -> None:
        self.block_ids[:] = block_ids
        self._settle()

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.error = error
            self._settle()

    def _settle(self) -> None:
        self._event.set()
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    async def wait(self) -> list[int]:
        """The reserved block ids, once reserved; raises the reservation's error."""
        if not self.done:
            if self._future is None:
                self._future = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._future)  # a cancelled waiter leaves it to the others
        return self._result()

    def wait_blocking(self, timeout_s: float) -> list[int]:
        """wait() for a thread other than the event loop's."""
        if not self._event.wait(timeout_s):
            raise TimeoutError(f"no reservation within {timeout_s:.1f} s")
        return self._result()

    def _result(self) -> list[int]:
        if self.error is not None:
            raise self.error
        return self.block_ids


class HandoffMixin:
    def held_blocks(self, request_id: str) -> list[int]:
        """Blocks of a finished hold_blocks request, holding K/V of all its tokens but the last."""
        (seq,) = self.requests[request_id]
        return list(seq.block_table)

    def release(self, request_id: str) -> int:
        """Free the blocks a finished hold_blocks request kept; returns how many were held."""
        seqs = self.requests.pop(request_id, [])
        held = 0
        for seq in seqs:
            if seq.finished:
                held += len(seq.block_table)
                self.scheduler.free_blocks(seq)
            else:  # still running: an abort
                seq.hold_blocks = False
                self.scheduler.finish(seq, "abort")
        return held

    def probe_cached_blocks(self, prompt_ids: list[int], cache_salt: str | None = None, lora: str | None = None) -> int:
        """How many of the prompt's leading full blocks the prefix cache holds now, as reserve()
        would find them. Safe off the engine thread (it only reads the cache's index, under the
        GIL), but the answer may be stale by the time reserve() runs: see max_cached_blocks."""
        if not self.pool.enable_prefix_caching:
            return 0
        bs, cached = self.args.block_size, self.pool.cached
        adapters = getattr(self.model, "adapters", None)
        if lora is not None and adapters is not None and lora in adapters.index:  # the key make_request salts by
            lora = adapters.cache_keys[adapters.index[lora]]
        parent, n = cache_root(cache_salt, lora), 0
        for start in range(0, len(prompt_ids) - bs + 1, bs):  # hashed only up to the first miss
            parent = hash_block(parent, prompt_ids[start:start + bs])
            if parent not in cached:
                break
            n += 1
        return n

    def reserve(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0,
        cache_salt: str | None = None, max_cached_blocks: int | None = None,
    ) -> Sequence:
        """Decode side: allocate blocks for a prompt whose K/V another worker computed.

        The prompt's leading full blocks found in the prefix cache are shared, not allocated:
        seq.num_registered of them lead seq.block_table, and only the rest needs the K/V.
        max_cached_blocks (an early start's probe): share exactly that many, allocating fresh
        blocks after them even where the cache holds more; PrefixChangedError if it holds fewer.
        Raises NoFreeBlocksError when the pool cannot hold the prompt now (reject, never wait),
        and InvalidRequestError for bad input. The blocks stay outside scheduling until activate().
        """
        if params.n != 1:
            raise InvalidRequestError("n: a prefilled request carries exactly one sample", field="n")
        self._check_new_id(request_id)
        (seq,) = self.make_request(prompt_ids, params, request_id, priority, cache_salt=cache_salt)
        bs = self.args.block_size
        full = seq.prompt_len // bs  # the first token comes from the prefill worker: no block is recomputed
        self.scheduler.ensure_hashes(seq, full)
        shared = full if max_cached_blocks is None else min(full, max_cached_blocks)
        cached = self.pool.lookup(seq.block_hashes[:shared], seq.prompt_len, bs)
        if max_cached_blocks is not None and len(cached) < max_cached_blocks:
            self.pool.free(cached)
            raise PrefixChangedError(f"{max_cached_blocks} prefix-cache blocks were probed for request "
                                     f"{request_id!r}, {len(cached)} are left")
        try:
            fresh = self.pool.allocate(-(-seq.prompt_len // bs) - len(cached))  # raises NoFreeBlocksError
        except NoFreeBlocksError:
            self.pool.free(cached)
            raise
        seq.block_table = cached + fresh
        seq.num_registered = len(cached)
        seq.status = Status.RESERVED
        self.requests[request_id] = [seq]
        self.prompt_tokens_total += seq.prompt_len
        return seq

    def write_reserved(self, request_id: str, block_ids: list[int], write: Callable[[], None]) -> bool:
        """Run write() (copy K/V into block_ids) only while request_id still holds exactly those
        blocks as a reservation; False, writing nothing, once it does not (aborted, or its id
        reused by a new reservation). Callable from any thread: abort() of a reservation waits
        for a write in progress, so its blocks are never freed and reused under the copy."""
        with self._reserved_lock:
            seqs = self.requests.get(request_id)
            if not seqs or seqs[0].status is not Status.RESERVED or seqs[0].block_table != block_ids:
                return False
            write()
            return True

    def settle_first_token(self, request_id: str, first_token: int, first_logprob=None) -> RequestOutput | None:
        """Decode side, any thread: the reserved blocks now hold the prompt's K/V; append first_token
        and return its output (text, stop checks) without waiting for the engine thread, which
        then schedules the sequence in activate(). None, changing nothing, once the request no
        longer holds its reservation (aborted).

        The prefill worker sampled first_token with the same seed, so this sequence's random stream
        is advanced past that draw and later tokens match a single-process run. A reserved
        sequence is touched by no step, and abort() takes the same lock, so this cannot race it.
        """
        with self._reserved_lock:
            seqs = self.requests.get(request_id)
            if not seqs or seqs[0].status is not Status.RESERVED or len(seqs[0].token_ids) > seqs[0].prompt_len:
                return None
            (seq,) = seqs
            if seq.rng is not None:
                seq.rng.random()
            seq.num_computed = seq.prompt_len
            seq.token_ids.append(first_token)
            seq.metrics.first_token_time = time.monotonic()
            # Recorded on the sequence for activate(), which finishes it (it frees blocks: engine thread).
            seq.finish_reason, seq.stop_reason = self._stop_check(seq, first_token)
            return self._output(seq, [first_token], seq.detok.take(final=seq.finish_reason is not None),
                                [first_logprob] if first_logprob else None)

    def activate(self, request_id: str) -> bool:
        """Decode side, engine thread, after settle_first_token: schedule the sequence (or finish it,
        if its first token ended it). False if the request was aborted in between."""
        seqs = self.requests.get(request_id)
        if not seqs:
            return False
        (seq,) = seqs
        if seq.status is not Status.RESERVED or len(seq.token_ids) != seq.prompt_len + 1:
            raise InvalidRequestError(f"request {request_id!r} is not a reservation with its first token",
                                      field="request_id")
        seq.first_admitted = True
        self.scheduler.register_full_blocks(seq)
        self.generation_tokens_total += 1
        if seq.finish_reason is not None:
            self._finish(seq, seq.finish_reason, seq.stop_reason, time.monotonic())
        else:
            seq.status = Status.RUNNING
            self.scheduler.insert_running(seq)
        return True
