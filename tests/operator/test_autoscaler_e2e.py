"""The autoscaler end to end: real HTTP /metrics endpoints with changing queue depths drive the
replicas of the prefill and decode Deployments in the emulated cluster, within the windows."""

from __future__ import annotations

import time

import pytest
from aiohttp import web
from kvrelay.operator import constants as c
from operator_harness import DEPLOYMENTS, EVENTS, ISVC, eventually, isvc_body

NS = "default"
DOWN_WINDOW = 4
SLACK = 2.0  # one interval plus a slow pass: a lower bound that never flakes, still far from immediate


class MetricsServer:
    """One /metrics endpoint serving gauges the test changes at will."""

    def __init__(self) -> None:
        self.gauges: dict[str, float] = {}
        self.scrapes = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> MetricsServer:
        async def metrics(_: web.Request) -> web.Response:
            self.scrapes += 1
            lines = []
            for sample, value in self.gauges.items():
                lines.append(f"# TYPE {sample.split('{')[0]} gauge")
                lines.append(f"{sample} {value}")
            return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/metrics"
        return self

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()


@pytest.fixture()
async def endpoints(cluster, monkeypatch):
    servers = {role: await MetricsServer().start() for role in c.ROLES}
    for role, server in servers.items():
        monkeypatch.setenv(c.SCRAPE_ENV[role], server.url)
    yield servers
    for server in servers.values():
        await server.stop()


def set_load(endpoints, prefill_queue=0, decode_queue=0, decode_waiting=0, decode_running=0, kv=0.0,
             prefill_waiting=0):
    gateway = endpoints["gateway"].gauges
    gateway[f'{c.METRIC_GATEWAY_QUEUE_DEPTH}{{model="demo",role="prefill"}}'] = prefill_queue
    gateway[f'{c.METRIC_GATEWAY_QUEUE_DEPTH}{{model="demo",role="decode"}}'] = decode_queue
    decode = endpoints["decode"].gauges
    decode[c.METRIC_WORKER_WAITING] = decode_waiting
    decode[c.METRIC_WORKER_RUNNING] = decode_running
    decode[c.METRIC_WORKER_KV_USAGE] = kv
    prefill = endpoints["prefill"].gauges
    prefill[c.METRIC_WORKER_WAITING] = prefill_waiting
    prefill[c.METRIC_WORKER_RUNNING] = 0


def replicas(cluster, role):
    return cluster.live(DEPLOYMENTS, NS, f"demo-{role}")["spec"]["replicas"]


def decision(cluster, role):
    return cluster.live(ISVC, NS, "demo")["status"]["autoscaler"][role]


async def test_queue_depth_scales_roles_independently_to_zero_and_back(cluster, endpoints, operator_runner):
    set_load(endpoints)
    scaling = {"intervalSeconds": 1, "targetPerReplica": 2, "scaleDownStabilizationSeconds": DOWN_WINDOW,
               "scaleUpStabilizationSeconds": 0, "maxStepReplicas": 10}
    await cluster.create(isvc_body(autoscaling=scaling,
                                   prefill={"replicas": 1, "minReplicas": 0, "maxReplicas": 4},
                                   decode={"replicas": 1, "minReplicas": 0, "maxReplicas": 6}))
    started = time.time()
    operator_runner()

    # Idle from the start: both roles go to zero, but not before the scale-down window passed.
    await eventually(lambda: replicas(cluster, "prefill") == 0 and replicas(cluster, "decode") == 0)
    assert time.time() - started >= DOWN_WINDOW
    await eventually(lambda: decision(cluster, "decode")["reason"] in ("ScaleToZero", "Idle"))
    assert endpoints["gateway"].scrapes > 0

    # A queued prefill request wakes prefill (ceil(5/2) = 3) and decode, which will need it next.
    set_load(endpoints, prefill_queue=5)
    await eventually(lambda: replicas(cluster, "prefill") == 3 and replicas(cluster, "decode") == 1)
    woke = await eventually(lambda: decision(cluster, "prefill")["reason"] == "WakeUp" and decision(cluster, "prefill"))
    assert (woke["current"], woke["desired"], woke["metricValue"], woke["target"]) == (0, 3, 5, 2)

    # Decode's own queue (gateway + workers' waiting) scales decode alone: ceil(3 × (9/3)/2)... = 5.
    set_load(endpoints, prefill_queue=5, decode_queue=1, decode_waiting=8, decode_running=4)
    await eventually(lambda: replicas(cluster, "decode") == 5)
    assert replicas(cluster, "prefill") == 3

    # Prefill's queue drains but decode still has work: prefill shrinks, never to zero while decode
    # has queued requests; decode keeps its replicas through the down window.
    set_load(endpoints, decode_queue=0, decode_waiting=10, decode_running=4)
    drained = time.time()
    await eventually(lambda: replicas(cluster, "prefill") == 1)
    assert time.time() - drained >= DOWN_WINDOW - SLACK
    assert replicas(cluster, "decode") == 5

    # All idle: both go to zero again, after the window.
    set_load(endpoints)
    idle_since = time.time()
    await eventually(lambda: replicas(cluster, "prefill") == 0 and replicas(cluster, "decode") == 0)
    assert time.time() - idle_since >= DOWN_WINDOW - SLACK

    # Every change was recorded as an Event on the InferenceService (posted asynchronously).
    def scaled_messages() -> str:
        return " | ".join(e.raw["message"] for k, e in cluster.objects.items()
                          if k[0] == EVENTS and not e.deleted and e.raw.get("reason") == "Scaled")

    await eventually(lambda: "decode: 5 -> 0 replicas (ScaleToZero" in scaled_messages())
    assert "prefill: 0 -> 3 replicas (WakeUp" in scaled_messages()
    assert "decode: 1 -> 5 replicas (QueueDepth" in scaled_messages()


async def test_prefill_queue_counts_the_prefill_workers_own_backlog(endpoints):
    """Requests the gateway already handed to prefill workers still wait there: they count too."""
    import aiohttp
    from kvrelay.operator.builders import Owner
    from kvrelay.operator.config import OperatorConfig
    from kvrelay.operator.metrics import read_signals

    set_load(endpoints, prefill_queue=2, prefill_waiting=5, decode_queue=1, decode_waiting=3)
    endpoints["prefill"].gauges[c.METRIC_WORKER_RUNNING] = 4
    async with aiohttp.ClientSession() as http:
        signals = await read_signals(http, OperatorConfig.from_env(), Owner("demo", NS, "uid"))
    assert (signals.prefill_queue, signals.prefill_running) == (2 + 5, 5 + 4)
    assert signals.decode_queue == 1 + 3


async def test_unreachable_gateway_metrics_hold_replicas(cluster, endpoints, operator_runner):
    await endpoints["gateway"].stop()
    await cluster.create(isvc_body(autoscaling={"intervalSeconds": 1, "scaleDownStabilizationSeconds": 0},
                                   prefill={"replicas": 2, "minReplicas": 0, "maxReplicas": 4}))
    operator_runner()
    await eventually(lambda: cluster.live(ISVC, NS, "demo").get("status", {}).get("replicas"))
    gets_before = sum(1 for r in list(cluster._requests) if r.resource == DEPLOYMENTS and r.method == "GET")
    await eventually(lambda: sum(1 for r in list(cluster._requests)
                                 if r.resource == DEPLOYMENTS and r.method == "GET") >= gets_before + 9)
    assert replicas(cluster, "prefill") == 2  # no signal, no scaling (and certainly not to zero)
