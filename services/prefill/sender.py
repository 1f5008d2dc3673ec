"""The prefill worker's half of the hand-off stream (mixed into PrefillWorker): forwards queued
chunks to the decode worker on whichever data plane it accepted (inline, shared-memory region,
transfer-engine region, CUDA IPC), then PrefillDone, and reacts to the ack, aborts and
interruptions. Doorbell hand-offs send their chunks from the engine thread instead
(engine_side.py); this loop then only waits for the ack or an interruption."""

from __future__ import annotations

import asyncio
import time

from kvrelay.engine.errors import InvalidRequestError
from kvrelay.kvtransfer.chunk_wire import encode_chunk_message, payload_size, place_chunk
from kvrelay.kvtransfer.convert import add_prompt_logprobs, logprob_to_proto
from kvrelay.kvtransfer.layout import chunk_header
from kvrelay.kvtransfer.status import abort_with
from kvrelay.prefill.copy_stream import PendingChunk
from kvrelay.prefill.handoff import Handoff, PipelinedWriter
from kvrelay.v1 import kv_pb2


class HandoffSender:
    """Needs from the worker: options, metrics, cuda_ipc, _layout_msg."""

    async def _send_loop(self, h: Handoff, context) -> str:
        """Forward chunks and the first token to the decode worker; returns why the hand-off ended."""
        out = PipelinedWriter(context)
        try:
            while True:
                ev = await h.events.get()
                if ev[0] == "chunk":
                    # An abort (either side), lease expiry or shutdown is queued behind the chunks:
                    # act on it now instead of sending them all first.
                    if h.lease.release_reason == "decode_abort":
                        return "decode_abort"
                    if h.interrupt is not None:
                        await out.flush()
                        return await self._handle_event(h, h.interrupt, context)
                    _, r, t = ev
                    checksum = None
                    if isinstance(t, PendingChunk):  # gathered on the GPU's copy stream
                        await t.wait()
                        t, checksum = t.payload, t.checksum_value()
                    if h.send_started_at is None:
                        h.send_started_at = time.monotonic()
                    header = chunk_header(self._layout_msg, r, h.lease.num_tokens)
                    size = payload_size(t)
                    if h.cuda_ipc is not None:  # the decode worker copies the held blocks itself
                        msg = self.cuda_ipc.chunk(header, t, h.block_table[r.block_start:r.block_end], checksum)
                    elif h.remote is not None:
                        try:  # the bytes land in the decode worker's region before the header goes
                            msg = await asyncio.to_thread(h.remote.place, header, t)
                        except (ConnectionError, ValueError) as e:
                            await out.flush()
                            why = f"remote write failed: {e}"
                            await context.write(kv_pb2.PrefillServerMessage(aborted=kv_pb2.PrefillAborted(reason=why)))
                            return "remote_write_failed"
                    elif h.shm is None:
                        msg = encode_chunk_message(header, t)
                    else:
                        msg = place_chunk(header, t, h.shm, h.shm_next)
                        h.shm_next += size
                    await out.write(msg, lambda size=size: self._chunk_sent(h, size))
                    if h.shm is not None or h.remote is not None:
                        # The bytes are already in place: let the small message go out now, not
                        # after the next chunk's copy (traced: it went ~1.1 ms later at 1k tokens).
                        await asyncio.sleep(0)
                    if self.options.debug_chunk_delay_s:
                        await out.flush()
                        await asyncio.sleep(self.options.debug_chunk_delay_s)
                    continue
                await out.flush()  # every chunk is out before any other message
                reason = await self._handle_event(h, ev, context)
                if reason is not None:
                    return reason
        finally:
            out.cancel()

    def _chunk_sent(self, h: Handoff, size: int) -> None:
        h.bytes_sent += size
        if not h.lease.compute_done:
            h.bytes_before_compute_done += size
        h.lease.renew(self.options.lease_seconds)

    async def _handle_event(self, h: Handoff, ev: tuple, context) -> str | None:
        """A non-chunk event; returns why the hand-off ends, or None to continue."""
        lease, kind = h.lease, ev[0]
        if kind == "done":
            await context.write(kv_pb2.PrefillServerMessage(done=self._done_message(h, ev[1])))
            h.done_sent = True
            lease.renew(self.options.lease_seconds)
            return None
        if kind == "ack":
            if h.done_sent:
                if h.send_started_at is not None:
                    # One clock, and nothing left out: gather, encode, wire, verify and cache write
                    # of every chunk, the first one included (to a doorbell ack's stamp of the
                    # last write, or a stream ack's arrival).
                    self.metrics.kv_send_seconds.observe(self._transfer_end(h, ev) - h.send_started_at)
                    self.metrics.kv_send_bytes.inc(h.bytes_sent)
                return "ack"
            why = "ack before the hand-off completed"
            await context.write(kv_pb2.PrefillServerMessage(aborted=kv_pb2.PrefillAborted(reason=why)))
            return "protocol_error"
        if kind == "abort":
            return "decode_abort"
        if kind == "gone":
            return "stream_broken"
        if kind in ("client_abort", "lease_expired", "shutdown"):
            lease.release_reason = kind
            await context.write(kv_pb2.PrefillServerMessage(aborted=kv_pb2.PrefillAborted(reason=ev[1])))
            return kind
        # kind == "error": the prefill itself failed
        exc = ev[1]
        if isinstance(exc, InvalidRequestError):
            await abort_with(context, exc)
        why = f"prefill failed: {exc}"
        await context.write(kv_pb2.PrefillServerMessage(aborted=kv_pb2.PrefillAborted(reason=why)))
        return "error"

    def _done_message(self, h: Handoff, out) -> kv_pb2.PrefillDone:
        done = kv_pb2.PrefillDone(
            first_token_id=out.new_token_ids[0], num_cached_tokens=out.num_cached_tokens,
            total_bytes=h.bytes_sent, bytes_before_compute_done=h.bytes_before_compute_done,
            prefill_seconds=time.monotonic() - h.started_at, has_logprob=bool(out.logprobs))
        if out.logprobs:
            done.first_logprob.CopyFrom(logprob_to_proto(out.logprobs[0]))
        prompt_lps = out.prompt_logprobs if out.prompt_logprobs is not None else h.prompt_logprobs
        if prompt_lps is not None:
            done.has_prompt_logprobs = True
            add_prompt_logprobs(done.prompt_logprobs, prompt_lps)
        return done
    def _transfer_end(self, h: Handoff, ev: tuple) -> float:
        """When the decode worker had every chunk written: a doorbell ack's stamp (one node, one
        monotonic clock), else when the ack was read here. Its way back is counted apart."""
        read_at = ev[1] if len(ev) > 1 else time.monotonic()
        written_at = ev[2] if len(ev) > 2 else None
        if written_at is None or not h.send_started_at <= written_at <= read_at:
            return read_at  # a stream ack, or clocks that differ (another time namespace)
        self.metrics.doorbell_ack_delay.observe(read_at - written_at)
        return written_at
