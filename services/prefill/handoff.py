"""One hand-off's state on the prefill worker, shared by the request handler (worker.py), the
stream sender (sender.py) and the engine-thread side (engine_side.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses

import numpy as np
from kvrelay.kvtransfer.doorbell import DoorbellConn
from kvrelay.kvtransfer.leases import Lease
from kvrelay.kvtransfer.mooncake import RemoteTarget
from kvrelay.v1 import kv_pb2


@dataclasses.dataclass(eq=False)
class Handoff:
    lease: Lease
    # ("chunk", range, payload) | ("done", out) | ("error", exc) | ("ack"[, read_at, written_at])
    # | abort/gone/...
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    num_blocks: int
    max_message_bytes: int
    first_block: int = 0  # the decode worker holds blocks before this one (its prefix cache)
    sent_layers: int = 0  # layers already gathered (engine thread only)
    bytes_sent: int = 0
    bytes_before_compute_done: int = 0
    done_sent: bool = False
    # When K/V first started towards the decode side (monotonic): the first layer-streamed chunk
    # taken for sending, or else the end of the prefill, before the remaining blocks are gathered.
    send_started_at: float | None = None
    shm: np.ndarray | None = None  # the decode worker's shared-memory region, when this worker can open it
    shm_next: int = 0  # where the next chunk's bytes go in it
    doorbell: DoorbellConn | None = None  # set: chunks and done go on the decode worker's doorbell
    ticket: bytes = b""  # the hand-off's name on the doorbell
    doorbell_error: Exception | None = None  # a ring failed (engine thread): the hand-off fails
    ring_job: concurrent.futures.Future | None = None  # the last rings queued on the ringer thread (engine_side)
    client_request_id: str = ""  # the client's X-Request-Id, from the decode worker's call metadata
    direct: bool = False  # the decode worker copies the blocks out of this worker's shared cache
    remote: RemoteTarget | None = None  # set: chunks' bytes go into the decode worker's transfer-engine region
    cuda_ipc: kv_pb2.CudaIpcCache | None = None  # set: the decode worker copies held blocks over CUDA IPC
    block_table: list[int] = dataclasses.field(default_factory=list)  # of the last gather (engine thread)
    started_at: float = 0.0  # when the prefill was submitted (monotonic)
    interrupt: tuple | None = None  # the first _interrupt's event, acted on before queued chunks
    prompt_logprobs: list | None = None  # the prefill's, when the request asked for them


class PipelinedWriter:
    """One chunk in flight while the caller encodes the next (gRPC allows one outstanding
    write per stream), so checksum and copies overlap the socket work."""

    def __init__(self, context):
        self.context = context
        self._task: asyncio.Task | None = None

    async def write(self, msg, on_sent) -> None:
        await self.flush()
        self._task = asyncio.create_task(self._write(msg, on_sent))

    async def _write(self, msg, on_sent) -> None:
        await self.context.write(msg)
        on_sent()

    async def flush(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            await task

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
