"""The load/health stream every worker publishes (LoadService.WatchLoad) and its Python view.

The gateway routes on it (queue, running, free blocks, prefix-cache block keys) and treats a
broken stream, or no report for a few intervals, as the worker's death.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from kvrelay.kvtransfer.layout import KVLayout
from kvrelay.v1 import load_pb2, load_pb2_grpc

log = logging.getLogger(__name__)
DEFAULT_INTERVAL_S = 0.5


@dataclass
class LoadReport:
    role: str
    layout: KVLayout
    max_model_len: int
    num_waiting: int
    num_running: int
    kv_blocks_total: int
    kv_blocks_free: int
    active_handoffs: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_digest: int
    # The full set when it changed since the previous report on this stream, else None:
    # keep the last set you received (watch_load does that for you: see `prefix_hashes_current`).
    prefix_hashes: set[int] | None
    sequence: int
    draining: bool
    prefix_hashes_current: set[int] = field(default_factory=set)
    node: str = ""  # where the worker runs; "" when unknown
    kv_shm: bool = False  # decode side: offers a shared-memory arena to prefill workers on its node

    @property
    def kv_usage(self) -> float:
        return 0.0 if not self.kv_blocks_total else 1.0 - self.kv_blocks_free / self.kv_blocks_total

    def cached_prefix_blocks(self, prompt_ids: list[int]) -> int:
        """How many leading full blocks of the prompt this worker's prefix cache holds (routing score)."""
        from kvrelay.engine.block_pool import prompt_block_hashes

        n = 0
        for h in prompt_block_hashes(prompt_ids, self.layout.block_size):
            if h not in self.prefix_hashes_current:
                break
            n += 1
        return n

    @property
    def all_blocks_free(self) -> bool:
        return self.kv_blocks_free == self.kv_blocks_total

    @classmethod
    def from_proto(cls, m: load_pb2.LoadReport) -> LoadReport:
        return cls(
            role=m.role, layout=KVLayout.from_proto(m.layout), max_model_len=m.max_model_len,
            num_waiting=m.num_waiting, num_running=m.num_running, kv_blocks_total=m.kv_blocks_total,
            kv_blocks_free=m.kv_blocks_free, active_handoffs=m.active_handoffs,
            prefix_cache_queries=m.prefix_cache_queries, prefix_cache_hits=m.prefix_cache_hits,
            prefix_digest=m.prefix_digest,
            prefix_hashes=set(m.prefix_hashes) if m.prefix_hashes_included else None,
            sequence=m.sequence, draining=m.draining, node=m.node, kv_shm=m.kv_shm,
        )


def prefix_digest(hashes: list[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack(f"<{len(hashes)}Q", *sorted(hashes)))
    return int.from_bytes(h.digest(), "little")


class LoadServicer(load_pb2_grpc.LoadServiceServicer):
    def __init__(self, role: str, engine, layout: KVLayout, active_handoffs: Callable[[], int],
                 default_interval_s: float = DEFAULT_INTERVAL_S, node: str = "", kv_shm: bool = False,
                 healthy: Callable[[], str | None] = lambda: None):
        self.role = role
        self.node = node
        self.kv_shm = kv_shm
        self.engine = engine
        self.layout = layout
        self.active_handoffs = active_handoffs
        self.default_interval_s = default_interval_s
        self.draining = False
        self.unhealthy = healthy  # None while healthy, else why not (the watchdog): the stream ends

    async def snapshot(self, timeout_s: float):
        """(stats, cached block hashes or None) read between engine steps; stats alone if the engine is busy."""
        try:
            return await asyncio.wait_for(
                self.engine.call_in_engine_thread(lambda llm: (llm.stats(), llm.pool.cached_hashes())), timeout_s)
        except TimeoutError:
            return self.engine.stats(), None

    async def WatchLoad(self, request, context):
        interval = request.interval_ms / 1000 if request.interval_ms else self.default_interval_s
        last_digest, seq = None, 0
        while True:
            problem = self.unhealthy()
            if problem is not None:  # gateways drop this worker at once, as for a dead one
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.role} worker unhealthy: {problem}")
            stats, hashes = await self.snapshot(interval)
            msg = load_pb2.LoadReport(
                role=self.role, layout=self.layout.to_proto(), max_model_len=self.engine.max_model_len,
                num_waiting=stats.num_waiting, num_running=stats.num_running,
                kv_blocks_total=stats.kv_blocks_total, kv_blocks_free=stats.kv_blocks_free,
                active_handoffs=self.active_handoffs(), prefix_cache_queries=stats.prefix_cache_queries,
                prefix_cache_hits=stats.prefix_cache_hits, sequence=seq, draining=self.draining,
                node=self.node, kv_shm=self.kv_shm)
            if hashes is not None:
                digest = prefix_digest(hashes)
                msg.prefix_digest = digest
                if digest != last_digest:
                    msg.prefix_hashes_included = True
                    msg.prefix_hashes.extend(hashes)
                    last_digest = digest
            elif last_digest is not None:
                msg.prefix_digest = last_digest
            yield msg
            seq += 1
            await asyncio.sleep(interval)
