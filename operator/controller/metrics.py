"""Reads the autoscaler's signals from the gateway's and the workers' Prometheus /metrics."""

from __future__ import annotations

import asyncio
import logging
import socket
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
from kvrelay.operator import constants as c
from kvrelay.operator.autoscale import Signals
from kvrelay.operator.builders import Owner
from kvrelay.operator.config import OperatorConfig
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

ROLE_PORTS = {"gateway": c.GATEWAY_METRICS_PORT, "prefill": c.WORKER_METRICS_PORT, "decode": c.WORKER_METRICS_PORT}


class MetricsUnavailable(RuntimeError):
    """A signal the autoscaler needs could not be read; it then keeps the current replicas."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_samples(text: str) -> list[Sample]:
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def scrape_url(config: OperatorConfig, owner: Owner, role: str) -> str:
    return config.scrape_url_templates[role].format(name=owner.name, namespace=owner.namespace, port=ROLE_PORTS[role])


async def resolve_all(url: str) -> list[str]:
    """One URL per address of the URL's host: a headless Service name yields every pod."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []  # e.g. a headless Service with no ready pods
    urls = []
    for address in sorted({info[4][0] for info in infos}):
        netloc = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        urls.append(urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, "")))
    return urls


async def fetch(session: aiohttp.ClientSession, url: str, timeout: float) -> list[Sample]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        response.raise_for_status()
        return parse_samples(await response.text())


async def scrape_role(session: aiohttp.ClientSession, config: OperatorConfig, owner: Owner, role: str) -> list[Sample]:
    """Samples of every reachable pod of a role; unreachable pods are skipped."""
    urls = await resolve_all(scrape_url(config, owner, role))
    results = await asyncio.gather(*(fetch(session, u, config.scrape_timeout_seconds) for u in urls),
                                   return_exceptions=True)
    samples: list[Sample] = []
    for url, result in zip(urls, results):
        if isinstance(result, BaseException):
            log.debug("scrape of %s failed: %r", url, result)
        else:
            samples += result
    return samples


async def read_signals(session: aiohttp.ClientSession, config: OperatorConfig, owner: Owner) -> Signals:
    gateway_url = scrape_url(config, owner, "gateway")
    try:
        gateway = await fetch(session, gateway_url, config.scrape_timeout_seconds)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        raise MetricsUnavailable(f"gateway metrics at {gateway_url}: {e!r}") from e
    prefill, decode = await asyncio.gather(
        scrape_role(session, config, owner, "prefill"), scrape_role(session, config, owner, "decode"))
    kv = [s.value for s in decode if s.name == c.METRIC_WORKER_KV_USAGE]
    # Each role's queue is the gateway's queue for it plus its own workers' backlog: requests the
    # gateway already dispatched still wait inside the workers' schedulers.
    return Signals(
        prefill_queue=(total(gateway, c.METRIC_GATEWAY_QUEUE_DEPTH, role="prefill")
                       + total(prefill, c.METRIC_WORKER_WAITING)),
        decode_queue=total(gateway, c.METRIC_GATEWAY_QUEUE_DEPTH, role="decode") + total(decode, c.METRIC_WORKER_WAITING),
        prefill_running=total(prefill, c.METRIC_WORKER_WAITING) + total(prefill, c.METRIC_WORKER_RUNNING),
        decode_running=total(decode, c.METRIC_WORKER_RUNNING),
        decode_kv_usage=sum(kv) / len(kv) if kv else None,
    )
