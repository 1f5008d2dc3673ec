"""The server's own view during a run: its Prometheus /metrics, scraped while the load runs.

Peaks of memory and KV-cache usage, and the deltas of its token and request counters (which
cross-check the client's counts). Names of kvrelay, vLLM and SGLang are known; a server without
/metrics is fine (every figure is then None). With --server-pid the resident set size of a
local server process is read from /proc instead, for servers that do not export it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

RSS = ("process_resident_memory_bytes",)
KV_USAGE = (
    "kvrelay:kv_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
)
COUNTERS = {  # what the delta means -> sample names, summed over labels
    "generation_tokens": (
        "kvrelay:generation_tokens_total",
        "vllm:generation_tokens_total",
        "sglang:generation_tokens_total",
    ),
    "prompt_tokens": (
        "kvrelay:prompt_tokens_total",
        "vllm:prompt_tokens_total",
        "sglang:prompt_tokens_total",
    ),
    "requests_finished": ("kvrelay:request_success_total", "vllm:request_success_total"),
}


def parse(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def first(samples: dict[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in samples:
            return samples[name]
    return None


def read_rss(pid: int) -> float | None:
    """VmRSS of a local process, in bytes (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass
class ServerSnapshot:
    rss_bytes: float | None = None
    kv_usage: float | None = None
    counters: dict[str, float] = field(default_factory=dict)


@dataclass
class ServerMetrics:
    """Scrapes a server's /metrics (and a local pid's RSS); None figures mean not exposed."""

    url: str | None
    pid: int | None = None
    timeout_s: float = 5.0
    api_key: str | None = None  # kvrelay's API port answers /metrics only with a key when it has tenants
    available: bool | None = None  # None: not tried yet

    async def snapshot(self, http: aiohttp.ClientSession) -> ServerSnapshot:
        snap = ServerSnapshot()
        if self.url and self.available is not False:
            try:
                headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
                async with http.get(self.url, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                    status, text = resp.status, await resp.text()
                if status == 200:
                    samples = parse(text)
                    self.available = True
                    snap.rss_bytes = first(samples, RSS)
                    snap.kv_usage = first(samples, KV_USAGE)
                    for key, names in COUNTERS.items():
                        value = first(samples, names)
                        if value is not None:
                            snap.counters[key] = value
                elif self.available is None:
                    self.available = False
            except (aiohttp.ClientError, TimeoutError, ValueError):
                if self.available is None:
                    self.available = False
        if self.pid:
            snap.rss_bytes = read_rss(self.pid)
        return snap


@dataclass
class Sampler:
    """Samples a ServerMetrics every interval while a run goes on; keeps peaks and counter deltas."""

    metrics: ServerMetrics
    interval_s: float = 1.0
    before: ServerSnapshot | None = None
    after: ServerSnapshot | None = None
    peak_rss_bytes: float | None = None
    peak_kv_usage: float | None = None
    _task: asyncio.Task | None = None

    def _absorb(self, snap: ServerSnapshot) -> None:
        if snap.rss_bytes is not None:
            self.peak_rss_bytes = max(self.peak_rss_bytes or 0.0, snap.rss_bytes)
        if snap.kv_usage is not None:
            self.peak_kv_usage = max(self.peak_kv_usage or 0.0, snap.kv_usage)

    async def start(self, http: aiohttp.ClientSession) -> None:
        self.before = await self.metrics.snapshot(http)
        self._absorb(self.before)

        async def loop():
            while True:
                await asyncio.sleep(self.interval_s)
                self._absorb(await self.metrics.snapshot(http))

        self._task = asyncio.create_task(loop())

    async def stop(self, http: aiohttp.ClientSession) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.after = await self.metrics.snapshot(http)
        self._absorb(self.after)

    def summary(self) -> dict:
        deltas = {}
        if self.before and self.after:
            for key, value in self.after.counters.items():
                # A labelled counter has no sample before its first increment: it was 0.
                deltas[key] = value - self.before.counters.get(key, 0.0)
        return {
            "metrics_exposed": bool(self.metrics.available),
            "peak_rss_bytes": self.peak_rss_bytes,
            "peak_kv_usage": self.peak_kv_usage,
            "counter_deltas": deltas,
        }


def metrics_url(base_url: str, override: str | None) -> str:
    """/metrics beside the API: http://host:port/v1 -> http://host:port/metrics."""
    if override:
        return override
    return base_url.rstrip("/").removesuffix("/v1") + "/metrics"
