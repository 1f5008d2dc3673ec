"""Leases on a prefill worker's held KV blocks.

A lease exists from the moment a decode worker opens a hand-off until the blocks are released:
on the decode side's ack, an abort from either side, the stream breaking, or the deadline. The
deadline starts when the prefill finished computing (the blocks are then held for nobody but
the decode worker) and moves forward each time a chunk is delivered, so a slow but live
transfer keeps its blocks while a decode worker that stopped reading loses them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


@dataclass(eq=False)
class Lease:
    lease_id: str  # also the request id inside the prefill engine (unique per attempt)
    request_id: str  # the client's id (for PrefillService.Abort and logs)
    num_tokens: int
    task: asyncio.Task | None = None  # the hand-off's handler; cancelled on expiry or abort
    compute_done: bool = False
    deadline: float | None = None  # time.monotonic(); None while the prefill still computes
    released: bool = False
    release_reason: str | None = None
    created: float = field(default_factory=time.monotonic)

    def renew(self, seconds: float) -> None:
        if self.compute_done:
            self.deadline = time.monotonic() + seconds


class LeaseTable:
    def __init__(self):
        self._by_id: dict[str, Lease] = {}

    def add(self, lease: Lease) -> None:
        self._by_id[lease.lease_id] = lease

    def remove(self, lease: Lease) -> None:
        self._by_id.pop(lease.lease_id, None)

    def by_request(self, request_id: str) -> list[Lease]:
        return [lease for lease in self._by_id.values() if lease.request_id == request_id]

    def expired(self, now: float | None = None) -> list[Lease]:
        now = time.monotonic() if now is None else now
        return [lease for lease in self._by_id.values()
                if not lease.released and lease.deadline is not None and lease.deadline < now]

    def __len__(self) -> int:
        return len(self._by_id)
