"""Helpers of the gateway tests: real redis-server processes and real gateways on free loopback ports."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server this test owns: it can be stopped and restarted on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


class InProcessGateway:
    """A real uvicorn server on a free loopback port, in a thread, with the real engine."""

    def __init__(self, tenants_file=None, config=None, quota=None, engine_kwargs=None, backend=None):
        import threading

        import uvicorn
        from kvrelay.engine.engine_args import EngineArgs
        from kvrelay.gateway.app import Gateway, create_app
        from kvrelay.gateway.backend import LocalBackend
        from kvrelay.gateway.frontdoor import uvicorn_options
        from kvrelay.gateway.tenants import TenantRegistry

        backend = backend or LocalBackend(EngineArgs(**(engine_kwargs or {})))
        self.gateway = Gateway(backend, TenantRegistry(tenants_file), quota, config)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.gateway), host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False,
                                                    **uvicorn_options(self.gateway.config.frontdoor)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine(self):
        return self.gateway.backend.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def write_tenants(path, tenants: list[dict]) -> str:
    import yaml

    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return str(path)


def wait_for_workers(backend, timeout: float = 30) -> None:
    """Until a DisaggregatedBackend has the load streams of its prefill and decode workers."""
    deadline = time.monotonic() + timeout
    while not backend.decode.live() or not backend.prefill.live():
        assert time.monotonic() < deadline, "workers never reported their load"
        time.sleep(0.05)


class GatewayProcess:
    """`kvrelay serve` (or `kvrelay gateway`) in its own process, real HTTP on a free loopback port."""

    def __init__(self, args: list[str], log_path, command: str = "serve") -> None:
        import os
        import sys

        self.port = free_port()
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", command, "--port", str(self.port),
                                      "--log-level", "warning", *args], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)
        self.wait_healthy()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = 60) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"gateway not ready after {timeout} s; see {self.log.name}")

    def metric(self, series: str) -> float:
        """One series' value from the worker's /metrics (0 when absent), e.g. 'name{label="x"}'."""
        import httpx

        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.rsplit(" ", 1)[0] == series)

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no cleanup runs
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


class WorkerProcess:
    """A real `kvrelay prefill|decode` worker on a free loopback port."""

    def __init__(self, role: str, *extra: str) -> None:
        import sys
        import tempfile
        import threading

        self.role = role
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in stop()
        self.metrics_port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", role, "--host", "127.0.0.1", "--port", "0",
                                      "--metrics-port", str(self.metrics_port), *extra],
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.address = None
        for line in self.proc.stdout:
            if " listening on " in line:
                self.address = line.split(" listening on ")[1].split()[0]
                break
        if self.address is None:
            self.stderr.seek(0)
            raise RuntimeError(f"{role} worker exited with {self.proc.wait()}: {self.stderr.read()[-3000:]}")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def generation_tokens(self) -> float:
        """kvrelay:generation_tokens_total from the worker's own /metrics."""
        import httpx

        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("kvrelay:generation_tokens_total"))

    def metric(self, series: str) -> float:
        """One series' value from the worker's /metrics (0 when absent), e.g. 'name{label="x"}'."""
        import httpx

        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.rsplit(" ", 1)[0] == series)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.stderr.close()


def engine_children(pid: int) -> list[int]:
    """The engine-core processes `kvrelay serve` (pid) started."""
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "kvrelay.engine.core.process"], check=False,
                         capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]
