"""Stall detection for streams in flight from a worker.

A stream is stalled when its worker stopped proving it is alive (its load stream broke or went
silent: routing's ejection, ~1 s for a frozen process), or when, after its first token, no token
came for longer than its stall timeout. The timeout is derived from the worker's recent
inter-token gaps (an exponentially weighted mean, times `factor`), bounded to
[`min_s`, `max_s`] (`--stall-timeout` sets `max_s`); before a worker has streamed anything it
is `max_s`. Before the first token only liveness counts: queueing and prefill may legitimately
take long, and the request's deadline bounds them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass


class StalledError(Exception):
    """The worker serving a stream stopped making progress; the caller abandons the stream."""


@dataclass
class StallConfig:
    max_s: float = 30.0  # the longest a started stream may go without a token
    min_s: float = 2.0  # the shortest: a fast worker's short hiccup is not a stall
    factor: float = 50.0  # times the worker's mean inter-token gap
    poll_s: float = 0.1  # how often a waiting stream checks its worker


class StepTimes:
    """Per-worker exponentially weighted mean of the gaps between a stream's outputs."""

    def __init__(self, config: StallConfig, alpha: float = 0.1):
        self.config = config
        self.alpha = alpha
        self._mean: dict[str, float] = {}

    def observe(self, worker: str, gap_s: float) -> None:
        m = self._mean.get(worker)
        self._mean[worker] = gap_s if m is None else m + self.alpha * (gap_s - m)

    def timeout(self, worker: str) -> float:
        m = self._mean.get(worker)
        c = self.config
        return c.max_s if m is None else min(c.max_s, max(c.min_s, c.factor * m))


_abandoned: set[asyncio.Task] = set()  # cancelled reads whose cleanup (an abort RPC) still runs


async def watch(stream: AsyncIterator, worker: str, alive: Callable[[], bool], times: StepTimes,
                clock: Callable[[], float] = time.monotonic) -> AsyncIterator:
    """Items of stream; StalledError when it stalls (see the module docstring). The stalled read is
    cancelled in the background: the stream's own cleanup (an explicit abort to a worker that may
    be frozen) must not delay the caller's retry or error."""
    last: float | None = None
    poll = times.config.poll_s
    while True:
        read = asyncio.ensure_future(stream.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({read}, timeout=poll)
                if done:
                    break
                if not alive():
                    raise StalledError(f"worker {worker} stopped reporting its load (frozen, dead or unhealthy)")
                limit = times.timeout(worker)
                if last is not None and clock() - last > limit:
                    raise StalledError(f"worker {worker} sent no token for {limit:.1f} s")
        except BaseException:
            if not read.done():
                read.cancel()
                _abandoned.add(read)
                read.add_done_callback(_abandoned.discard)
            raise
        try:
            item = read.result()
        except StopAsyncIteration:
            return
        now = clock()
        if last is not None and getattr(item, "new_token_ids", None):
            times.observe(worker, now - last)
        last = now
        yield item
