"""A periodic engine stats line, as vLLM logs one: prompt and generation throughput over the last
interval, running and waiting requests, KV cache usage, prefix-cache hit rate, preemptions.
Idle intervals (no tokens, nothing running or waiting) are not logged."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("kvrelay.stats")


class StatsLogger:
    def __init__(self, stats: Callable[[], object | None], interval_s: float = 10.0, name: str = "engine"):
        self.stats = stats
        self.interval_s = interval_s
        self.name = name
        self._last = None
        self._last_at = time.monotonic()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.interval_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.log_once()

    def log_once(self, now: float | None = None) -> dict | None:
        """Log the line for the interval since the last call; returns its fields (None: idle, not logged)."""
        s = self.stats()
        now = time.monotonic() if now is None else now
        if s is None:
            return None
        prev, self._last = self._last, s
        elapsed, self._last_at = max(1e-9, now - self._last_at), now

        def delta(name: str) -> int:
            return getattr(s, name) - (getattr(prev, name) if prev is not None else 0)

        prompt, generated = delta("prompt_tokens_total"), delta("generation_tokens_total")
        queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
        if not (prompt or generated or s.num_running or s.num_waiting):
            return None
        fields = {"prompt_throughput": round(prompt / elapsed, 1), "generation_throughput": round(generated / elapsed, 1),
                  "running": s.num_running, "waiting": s.num_waiting, "kv_cache_usage": round(s.kv_usage, 4),
                  "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
                  "preemptions": delta("num_preemptions")}
        log.info("%s: prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, running %d reqs, "
                 "waiting %d reqs, KV cache usage %.1f%%, prefix cache hit rate %.1f%%, preemptions %d",
                 self.name, fields["prompt_throughput"], fields["generation_throughput"], s.num_running,
                 s.num_waiting, 100 * s.kv_usage, 100 * fields["prefix_cache_hit_rate"], fields["preemptions"],
                 extra={"fields": fields})
        return fields
