"""Circuit breakers, one per worker, in the gateway.

    closed --(failure_threshold consecutive failures or timeouts)--> open
    open --(cooldown_s later, on the next request)--> half-open: exactly one probe request goes through
    half-open --(probe succeeds)--> closed;  --(probe fails)--> open again

This works beside the load stream's ejection (routing.WorkerPool.live): a broken or silent load
stream takes a worker out at once; a breaker catches a worker whose stream looks fine but whose
requests fail or stall. Each state change is logged once, and the state is the gauge
`kvrelay:worker_circuit_state{role,worker}` (0 closed, 1 open, 2 half-open), with
`kvrelay:worker_circuit_transitions_total{role,worker,state}` counting entries into each state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUE = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}


@dataclass
class BreakerConfig:
    failure_threshold: int = 3  # consecutive failures (or stalls, or timeouts) that open the breaker
    cooldown_s: float = 5.0  # open this long before one probe is let through


class CircuitBreaker:
    def __init__(self, role: str, worker: str, config: BreakerConfig, clock: Callable[[], float] = time.monotonic):
        self.role, self.worker, self.config, self.clock = role, worker, config, clock
        self.state = CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.probing = False  # half-open: the one probe is in flight
        self.transitions = {CLOSED: 0, OPEN: 0, HALF_OPEN: 0}

    def _enter(self, state: str, why: str) -> None:
        if state == self.state:
            return
        log.warning("%s worker %s: circuit %s -> %s (%s)", self.role, self.worker, self.state, state, why)
        self.state = state
        self.transitions[state] += 1
        if state == OPEN:
            self.opened_at = self.clock()

    def available(self) -> bool:
        """Whether a request may be sent now (no side effect)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            return self.clock() - self.opened_at >= self.config.cooldown_s
        return not self.probing

    def acquire(self) -> None:
        """A request is being sent to the worker (after available() said yes)."""
        if self.state == OPEN and self.clock() - self.opened_at >= self.config.cooldown_s:
            self._enter(HALF_OPEN, f"{self.config.cooldown_s:g} s cool-down over: one probe")
        if self.state == HALF_OPEN:
            self.probing = True

    def success(self) -> None:
        self.failures = 0
        if self.state != CLOSED:
            self.probing = False
            self._enter(CLOSED, "probe succeeded")

    def failure(self, why: str) -> None:
        self.failures += 1
        if self.state == HALF_OPEN:
            self.probing = False
            self._enter(OPEN, f"probe failed: {why}")
        elif self.state == CLOSED and self.failures >= self.config.failure_threshold:
            self._enter(OPEN, f"{self.failures} consecutive failures, last: {why}")
        elif self.state == OPEN:
            self.opened_at = self.clock()

    def release(self) -> None:
        """The request ended with neither verdict (client gone, deadline): free the probe slot."""
        self.probing = False


class Breakers:
    """The breakers of one gateway, by (role, worker); a Prometheus collector of their state."""

    def __init__(self, config: BreakerConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or BreakerConfig()
        self.clock = clock
        self._by_worker: dict[tuple[str, str], CircuitBreaker] = {}

    def get(self, role: str, worker: str) -> CircuitBreaker:
        key = (role, worker)
        b = self._by_worker.get(key)
        if b is None:
            b = self._by_worker[key] = CircuitBreaker(role, worker, self.config, self.clock)
        return b

    def unavailable(self, role: str) -> set[str]:
        return {w for (r, w), b in self._by_worker.items() if r == role and not b.available()}

    def forget(self, role: str, worker: str) -> None:
        self._by_worker.pop((role, worker), None)

    def describe(self):
        return []

    def collect(self):
        state = GaugeMetricFamily("kvrelay:worker_circuit_state",
                                  "Circuit breaker of each worker: 0 closed, 1 open, 2 half-open",
                                  labels=["role", "worker"])
        entered = CounterMetricFamily("kvrelay:worker_circuit_transitions",
                                      "Circuit breaker state changes, by the state entered",
                                      labels=["role", "worker", "state"])
        for (role, worker), b in sorted(self._by_worker.items()):
            state.add_metric([role, worker], STATE_VALUE[b.state])
            for name, count in b.transitions.items():
                entered.add_metric([role, worker, name], count)
        yield state
        yield entered
