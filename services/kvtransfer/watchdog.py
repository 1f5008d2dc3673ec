"""The step-loop watchdog of a worker (and of `kvrelay serve`'s in-process engine).

The engine thread stamps `AsyncEngine.heartbeat` every time round its loop (an idle loop goes
round every 0.5 s). A loop that has not gone round for `limit_s()` — `factor` times the mean
step time, at least `timeout_s` — is hung: the watchdog marks the process unhealthy (its load
stream ends with UNAVAILABLE, so gateways drop it at once; `/ready` and `/health` answer 503),
and `grace_s` later it sets `expired`, on which the process exits with code 1 so that
Kubernetes (or `serve --disaggregated`'s supervisor) restarts it. A process whose engine thread
is stuck in a kernel or a deadlock cannot recover by itself; an open port would keep taking work.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

HANG_AFTER_STEPS_ENV = "KVRELAY_DEBUG_HANG_AFTER_STEPS"  # test hook: the step loop hangs after N steps


@dataclass
class WatchdogConfig:
    timeout_s: float = 30.0  # the shortest time without a loop round that counts as hung
    factor: float = 100.0  # ... or this many mean step times, if longer
    grace_s: float = 10.0  # unhealthy this long, then exit
    poll_s: float = 0.25


class Watchdog:
    def __init__(self, engine, config: WatchdogConfig | None = None, name: str = "engine"):
        self.engine = engine
        self.config = config or WatchdogConfig()
        self.name = name
        self.unhealthy_since: float | None = None
        self.reason = ""
        self.expired = asyncio.Event()
        self._task: asyncio.Task | None = None

    def limit_s(self) -> float:
        return max(self.config.timeout_s, self.config.factor * getattr(self.engine, "mean_step_s", 0.0))

    @property
    def healthy(self) -> bool:
        return self.unhealthy_since is None

    def check(self, now: float | None = None) -> bool:
        """Update the verdict; True while healthy."""
        now = time.monotonic() if now is None else now
        idle = now - getattr(self.engine, "heartbeat", now)
        if idle <= self.limit_s():
            if self.unhealthy_since is not None:
                log.warning("kvrelay %s: the step loop moves again after %.1f s", self.name, idle)
            self.unhealthy_since, self.reason = None, ""
            return True
        if self.unhealthy_since is None:
            self.unhealthy_since = now
            self.reason = f"the step loop made no progress for {idle:.1f} s (limit {self.limit_s():.1f} s)"
            log.error("kvrelay %s: unhealthy: %s; exiting in %.0f s unless it recovers", self.name, self.reason,
                      self.config.grace_s)
        elif now - self.unhealthy_since >= self.config.grace_s and not self.expired.is_set():
            log.error("kvrelay %s: the step loop is still hung after %.0f s: exiting so that it is restarted",
                      self.name, self.config.grace_s)
            self.expired.set()
        return False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.check()
            await asyncio.sleep(self.config.poll_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def install_hang_hook(engine, after_steps: int | None) -> None:
    """Test hook: the engine thread blocks forever before step after_steps + 1 (None: off)."""
    if after_steps is None:
        return
    count = [0]
    forever = threading.Event()

    def before_step() -> None:
        count[0] += 1
        if count[0] > after_steps:
            log.warning("debug hook: the step loop hangs now")
            forever.wait()

    engine.before_step = before_step
