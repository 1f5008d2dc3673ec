"""The prefill worker's engine-thread side (mixed into PrefillWorker): the model's layer hook that
streams finished layer groups during the prompt's last step, the gather of the held blocks that
were not streamed, and the doorbell rings (chunks and PrefillDone placed and signalled straight
from the engine thread, AsyncEngine.after_step; a GPU cache's chunks, and the CUDA IPC plane's,
from a ringer thread once they are ready). Nothing here may raise into the engine."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from kvrelay.engine.sequence import Status
from kvrelay.kvtransfer.chunk_wire import (
    Payload,
    payload_arrays,
    payload_pieces,
    payload_size,
    pieces_checksum,
    place_chunk,
)
from kvrelay.kvtransfer.layout import ChunkRange, chunk_header, plan_chunks
from kvrelay.prefill.copy_stream import CopyStream, PendingChunk
from kvrelay.prefill.handoff import Handoff
from kvrelay.v1 import kv_pb2

log = logging.getLogger(__name__)


class EngineThreadSide:
    """Needs from the worker: llm, layout, group, options, _lock, _streaming, _final, _ringing,
    _by_ticket, _source_msg, and _done_message (HandoffSender)."""

    _copy_stream: CopyStream | None = None  # made at the first gather from a GPU cache
    _ringer: ThreadPoolExecutor | None = None  # rings of chunks gathered on the copy stream, made at the first

    def _gather(self, h: Handoff, block_table: list[int], lo: int, hi: int) -> list[tuple[ChunkRange, Payload]]:
        ranges = plan_chunks(self.layout, lo, hi, h.num_blocks, h.max_message_bytes, h.first_block)
        if self.llm.executor is not None:  # tensor/pipeline parallel: every rank sends its heads and layers
            out = [(r, self.llm.executor.gather_blocks(block_table[r.block_start:r.block_end], r.layer_start,
                                                      r.layer_end)) for r in ranges]
        elif self.llm.device.type == "cpu":
            # Views of the held blocks: encoding joins them straight into the message, so the
            # sender's CPU (the hand-off's bottleneck on one core) skips a gather copy and the
            # engine thread no longer spends ~0.5 ms per 4 MiB chunk gathering.
            cache = self.llm.kv_cache
            out = [(r, payload_pieces(cache, block_table[r.block_start:r.block_end], r.layer_start, r.layer_end))
                   for r in ranges]
        else:  # a GPU cache: gathered on the copy stream, the engine thread goes on
            if self._copy_stream is None:
                self._copy_stream = CopyStream(self.llm.device)
            # CUDA IPC: the checksum runs on the GPU, the bytes never leave it.
            out = self._copy_stream.gather(self.llm.ops, self.llm.kv_cache, block_table, ranges,
                                           checksum=h.cuda_ipc is not None)
        h.sent_layers = hi
        h.block_table = block_table
        return out

    def _gather_rest(self, h: Handoff) -> list[tuple[ChunkRange, Payload]]:
        """After the first token: the layers the hook did not send, from the held blocks."""
        if h.lease.released or h.sent_layers >= self.layout.num_layers:
            return []
        return self._gather(h, self.llm.held_blocks(h.lease.lease_id), h.sent_layers, self.layout.num_layers)

    def _on_layer(self, layer_idx: int, batch) -> None:
        """Model hook: layer layer_idx just wrote its K/V for this step. Never raises: a failure
        here would stop the engine; the layers not streamed are sent from the held blocks instead."""
        try:
            self._stream_layers(layer_idx, batch)
        except Exception:
            log.exception("layer-wise streaming failed; the rest goes after the prefill")
            with self._lock:
                for h in self._final:
                    self._streaming.pop(h.lease.lease_id, None)
            self._final = []

    def _stream_layers(self, layer_idx: int, batch) -> None:
        if layer_idx == 0:
            with self._lock:
                candidates = list(self._streaming.values())
            self._final = [h for h in candidates if self._completes_prompt(h, batch)]
        if not self._final:
            return
        hi = layer_idx + 1
        for h in self._final:
            if h.lease.released or hi - h.sent_layers < self.group and hi < self.layout.num_layers:
                continue
            (seq,) = self.llm.requests[h.lease.lease_id]
            chunks = self._gather(h, seq.block_table, h.sent_layers, hi)
            if h.doorbell is not None:
                self._ring(h, chunks, during_compute=True)
                continue
            for r, t in chunks:
                h.loop.call_soon_threadsafe(h.events.put_nowait, ("chunk", r, t))

    def _after_step(self, outputs) -> None:
        """AsyncEngine.after_step: ring with the rest of the K/V and the first token of each
        doorbell hand-off whose prefill this step finished, before the output reaches the loop."""
        with self._lock:
            if not self._ringing:
                return
            finished = [(self._ringing.pop(o.request_id), o) for o in outputs
                        if o.finished and o.request_id in self._ringing]
        for h, out in finished:
            if not out.new_token_ids:
                continue  # aborted or failed: _compute reports it on the stream
            try:
                chunks = self._gather_rest(h)
            except Exception as e:  # noqa: BLE001 - must not stop the engine; the hand-off fails
                h.doorbell_error = e
                continue
            # Chunks as planned (up to max_message_bytes each): smaller frames, e.g. one per layer
            # group, measured no faster at 128 tokens (the copies are bound by cold caches).
            self._ring(h, chunks, out)

    def _ring(self, h: Handoff, chunks: list[tuple[ChunkRange, Payload]], out=None,
              during_compute: bool = False) -> None:
        """Engine thread: for each chunk, place it in the region (or name its held blocks) and send
        its header in a frame on the doorbell, so the decode worker copies one chunk while the next
        is placed; PrefillDone (when out, the prefill's last output, is given) goes in the last frame.

        Chunks of a GPU cache are still being gathered (or checksummed) on the copy stream, and the
        compute may still be writing the blocks the decode worker would copy: their frames go from
        one ringer thread, in order, each once its chunk's event fired, and the engine thread goes
        on (_compute waits for the last job, h.ring_job). Never raises: a failure is kept in
        h.doorbell_error, and _compute reports it on the stream."""
        held = [(r, t, h.block_table[r.block_start:r.block_end]) for r, t in chunks]  # the next gather moves it
        # CUDA IPC always takes the ringer: the CPU rehearsal of the plane (tests) then runs the GPU's threads.
        if h.cuda_ipc is None and h.ring_job is None and not any(isinstance(t, PendingChunk) for _, t in chunks):
            self._ring_frames(h, held, out, during_compute)
            return
        if self._ringer is None:
            self._ringer = ThreadPoolExecutor(1, thread_name_prefix="kvrelay-ring")
        h.ring_job = self._ringer.submit(self._ring_frames, h, held, out, during_compute)

    def _ring_frames(self, h: Handoff, held: list, out, during_compute: bool) -> None:
        """One frame per (range, payload, held block ids), PrefillDone in the last; see _ring."""
        frames = [[c] for c in held] or [[]]
        for i, frame_chunks in enumerate(frames):
            last = i == len(frames) - 1
            if h.doorbell_error is not None or h.lease.released:
                return
            try:
                self._ring_one(h, frame_chunks, out if last else None, during_compute)
            except Exception as e:  # noqa: BLE001 - see _ring
                log.warning("doorbell hand-off of %s failed: %s", h.lease.request_id, e)
                h.doorbell_error = e
                return
            if self.options.debug_chunk_delay_s and not (last and out is not None):
                time.sleep(self.options.debug_chunk_delay_s)  # fault injection: holds the ringing thread

    def _ring_one(self, h: Handoff, chunks: list, out, during_compute: bool) -> None:
        if h.send_started_at is None:
            h.send_started_at = time.monotonic()
        frame = kv_pb2.DoorbellFrame(ticket=h.ticket)
        for r, t, source_ids in chunks:
            checksum = None
            if isinstance(t, PendingChunk):  # gathered on the GPU's copy stream
                t.done.synchronize()
                t, checksum = t.payload, t.checksum_value()
            header = chunk_header(self._layout_msg, r, h.lease.num_tokens)
            if h.cuda_ipc is not None:  # the decode worker copies these blocks over CUDA IPC
                chunk = self.cuda_ipc.chunk(header, t, source_ids, checksum).chunk
                size = payload_size(t)
            elif h.direct:  # the decode worker copies these blocks out of our cache
                chunk = header
                chunk.source_block_ids.extend(source_ids)
                size = payload_size(t)
            else:
                chunk = place_chunk(header, t, h.shm, h.shm_next).chunk
                size = chunk.shm_size
                h.shm_next += size
            h.bytes_sent += size
            if during_compute:
                h.bytes_before_compute_done += size
            frame.chunks.append(chunk)
        if h.cuda_ipc is not None and chunks:
            frame.cuda_ipc.CopyFrom(h.cuda_ipc)  # it may overtake the stream's header
        if h.direct and chunks:
            # Ring with the headers first, then hash while the decode worker copies (the two cores
            # overlap: 1.3-1.5x kv_shm_floor.py's direct path), and send the hashes after.
            frame.source.CopyFrom(self._source_msg)
            self._send(h, frame)
            frame = kv_pb2.DoorbellFrame(ticket=h.ticket, checksums=[pieces_checksum(payload_arrays(t))
                                                                     for _, t, _ in chunks])
        if out is not None:
            frame.done.CopyFrom(self._done_message(h, out))
            # Before the ring: the decode worker's ack can reach the event loop before this
            # thread runs its next line, and an ack before done is a protocol error.
            h.done_sent = True
        self._send(h, frame)

    def _send(self, h: Handoff, frame: kv_pb2.DoorbellFrame) -> None:
        if not h.doorbell.ring(frame):
            raise ConnectionError(f"the doorbell socket {h.doorbell.path} broke: the decode worker left or stopped "
                                  f"reading")
        h.lease.renew(self.options.lease_seconds)
    def _on_doorbell_ack(self, ticket: bytes, read_at: float, written_at: float | None) -> None:
        """A doorbell connection's reader thread."""
        with self._lock:
            h = self._by_ticket.get(ticket)
        if h is not None:
            h.loop.call_soon_threadsafe(h.events.put_nowait, ("ack", read_at, written_at))

    def _completes_prompt(self, h: Handoff, batch) -> bool:
        """Whether this step computes the last prompt tokens of h's sequence."""
        seqs = self.llm.requests.get(h.lease.lease_id)
        if not seqs:
            return False
        seq = seqs[0]
        if seq.status is not Status.RUNNING or seq.num_computed >= seq.prompt_len:
            return False
        n = len(seq.block_table)
        for tables, lens in ((batch.prefill_block_tables, batch.prefill_seq_lens),
                             (batch.decode_block_tables, batch.decode_seq_lens)):
            for row, length in enumerate(lens.tolist()):
                if length == seq.prompt_len and tables[row, :n].tolist() == seq.block_table:
                    return True
        return False
