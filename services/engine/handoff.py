"""The engine's side of the prefill/decode hand-off: a prefill worker keeps a finished request's
blocks (hold_blocks) until its K/V has left; a decode worker reserves blocks for a prompt another
worker computed, has the K/V written into them, then activates the sequence as if it had prefilled.

A mixin of LLMEngine, kept apart so the step loop reads in one file and the hand-off in another.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvrelay.engine.block_pool import NoFreeBlocksError
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.outputs import RequestOutput
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence, Status


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

    def reserve(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0,
        cache_salt: str | None = None,
    ) -> Sequence:
        """Decode side: allocate blocks for a prompt whose K/V another worker computed.

        The prompt's leading full blocks found in the prefix cache are shared, not allocated:
        seq.num_registered of them lead seq.block_table, and only the rest needs the K/V.
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
        cached = self.pool.lookup(seq.block_hashes[:full], seq.prompt_len, bs)
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

    def activate(self, request_id: str, first_token: int, first_logprob=None) -> RequestOutput:
        """Decode side: the reserved blocks now hold the prompt's K/V; continue after first_token.

        The prefill worker sampled first_token with the same seed, so this sequence's random stream
        is advanced past that draw and later tokens match a single-process run.
        """
        (seq,) = self.requests[request_id]
        if seq.status is not Status.RESERVED:
            raise InvalidRequestError(f"request {request_id!r} is not reserved", field="request_id")
        if seq.rng is not None:
            seq.rng.random()
        seq.num_computed = seq.prompt_len
        seq.first_admitted = True
        self.scheduler.register_full_blocks(seq)
        seq.status = Status.RUNNING
        self.scheduler.insert_running(seq)
        return self._append_token(seq, first_token, first_logprob, time.monotonic())
