"""`kvrelay serve --disaggregated`'s local workers, supervised: one that exits is restarted on the same
address with backoff, and serve gives up (exit code 1) only after `max_restarts` consecutive failed
restarts of one worker (a restart counts as good once it has listened for `stable_s`).

While the prefill worker is down the gateway finds no live prefill worker and the decode worker
prefills locally; while the decode worker is down requests get a 503 with Retry-After; a stream
in flight on a worker that died ends with an SSE error event (the gateway's own handling).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class RestartPolicy:
    max_restarts: int = 5  # consecutive failed restarts of one worker before serve exits; 0: never restart
    backoff_s: float = 0.5  # first wait before a restart, doubled after each failure
    max_backoff_s: float = 8.0
    stable_s: float = 30.0  # up this long: the failure count starts again


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Supervisor:
    """start(role, port) -> a started process, or raises RuntimeError if it failed to come up."""

    def __init__(self, roles: list[str], start: Callable[[str, int], subprocess.Popen],
                 policy: RestartPolicy | None = None, host: str = "127.0.0.1"):
        self.policy = policy or RestartPolicy()
        self._start = start
        self.ports = {role: free_port(host) for role in roles}  # kept across restarts: one address each
        self.addresses = {role: f"{host}:{port}" for role, port in self.ports.items()}
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts = dict.fromkeys(roles, 0)
        self.stopping = False
        self.gave_up: str | None = None  # the role that could not be brought back
        self.on_give_up: Callable[[str], None] = lambda role: None
        self._threads: list[threading.Thread] = []

    def start_all(self) -> None:
        for role, port in self.ports.items():
            self.procs[role] = self._start(role, port)  # a first start that fails is serve's start-up error
        for role in self.ports:
            t = threading.Thread(target=self._watch, args=(role,), name=f"kvrelay-supervise-{role}", daemon=True)
            t.start()
            self._threads.append(t)

    def _watch(self, role: str) -> None:
        failures = 0
        while not self.stopping:
            proc = self.procs[role]
            started = time.monotonic()
            code = proc.wait()
            if self.stopping:
                return
            if time.monotonic() - started >= self.policy.stable_s:
                failures = 0
            while not self.stopping:
                if failures >= self.policy.max_restarts:
                    log.error("kvrelay serve: the local %s worker exited with code %s and did not come back "
                              "after %d restarts; stopping", role, code, failures)
                    self.gave_up = role
                    self.on_give_up(role)
                    return
                delay = min(self.policy.max_backoff_s, self.policy.backoff_s * 2 ** failures)
                failures += 1
                log.warning("kvrelay serve: the local %s worker exited with code %s; restarting it in %.1f s "
                            "(try %d of %d)", role, code, delay, failures, self.policy.max_restarts)
                time.sleep(delay)
                if self.stopping:
                    return
                try:
                    self.procs[role] = self._start(role, self.ports[role])
                except (RuntimeError, OSError, SystemExit) as e:
                    code = str(e)
                    continue
                self.restarts[role] += 1
                log.warning("kvrelay serve: the local %s worker is back on %s", role, self.addresses[role])
                break

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stopping = True
        procs = list(self.procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
