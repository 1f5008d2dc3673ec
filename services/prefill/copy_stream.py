"""Gathers of held K/V from a GPU cache on a side CUDA stream.

The layer hook runs on the engine thread right after a layer group's K/V writes were launched,
while the GPU is still computing. A gather on the compute stream followed by a copy to the host
(`.cpu()`) would make the engine thread wait there for the whole step so far and put the
device-to-host copy in line with the compute. Here the copy stream waits for the writes queued so
far (an event, not the host), gathers the blocks, and copies them into pinned host memory (the
inline, shared-memory and Mooncake planes); for the CUDA IPC plane it gathers nothing, computes
the device checksum straight from the blocks (block_checksum) and copies that one number back.
An event recorded after each chunk tells the sender (or the doorbell's ringer thread) when it is
ready; the engine thread goes on launching the next layers meanwhile.

Buffers allocated here are used on the copy stream only, so the caching allocator may reuse them
once they are dropped without further fencing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
from kvrelay.kvtransfer.cuda_ipc import K1, K2, checksum_int, device_checksum_tensor


@dataclass
class PendingChunk:
    """A chunk gathered on the copy stream, valid once `done` has fired: payload (pinned host memory;
    for CUDA IPC a meta tensor of the chunk's shape, or the gathered blocks on the GPU) and, for CUDA
    IPC, its checksum on the host."""

    payload: torch.Tensor
    done: torch.cuda.Event
    checksum: torch.Tensor | None = None  # pinned int64 scalar

    async def wait(self) -> None:
        if not self.done.query():  # the event loop stays free while the copy runs
            await asyncio.to_thread(self.done.synchronize)

    def checksum_value(self) -> int | None:
        return None if self.checksum is None else checksum_int(self.checksum)


class CopyStream:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def gather(self, ops, kv_cache: torch.Tensor, block_table: list[int], ranges: list, checksum: bool) -> list:
        """[(range, PendingChunk)] of ops.gather_blocks for each ChunkRange, ordered after the work
        queued on the current stream; checksum: CUDA IPC (the checksum comes back, the bytes stay)."""
        from kvrelay.kernels.triton_checksum import block_checksum, block_words

        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        out = []
        with torch.cuda.stream(self.stream):
            # Pinned and non-blocking: a pageable copy would wait for the stream, i.e. the compute.
            ids = torch.tensor(block_table, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
            for r in ranges:
                held = ids[r.block_start:r.block_end]
                host_sum = None
                if checksum:
                    host_sum = torch.empty((), dtype=torch.int64, pin_memory=True)
                    if block_words(kv_cache) is not None:  # straight from the blocks, nothing gathered
                        host_sum.copy_(block_checksum(kv_cache, held, r.layer_start, r.layer_end, K1, K2),
                                       non_blocking=True)
                        # The chunk's shape, no bytes: the decode worker copies them from the cache.
                        t = torch.empty((r.layer_end - r.layer_start, 2, len(held), *kv_cache.shape[3:]),
                                        dtype=kv_cache.dtype, device="meta")
                    else:
                        t = ops.gather_blocks(kv_cache, held, r.layer_start, r.layer_end)
                        host_sum.copy_(device_checksum_tensor(t), non_blocking=True)
                else:
                    t = ops.gather_blocks(kv_cache, held, r.layer_start, r.layer_end)
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    host.copy_(t, non_blocking=True)
                    t = host
                done = torch.cuda.Event()
                done.record(self.stream)
                out.append((r, PendingChunk(t, done, host_sum)))
        return out
