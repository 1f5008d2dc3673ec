"""Priority bands and VTC fairness: the scheduler alone, then end to end through HTTP."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from gateway_helpers import InProcessGateway, write_tenants
from kvrelay.gateway.app import GatewayConfig
from kvrelay.gateway.scheduler import FairScheduler, QueueFull
from kvrelay.gateway.tenants import hash_key


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 1.0


async def serve_in_order(sched: FairScheduler, tickets) -> list:
    """Grant order of `tickets` when each granted request finishes before the next is granted."""
    order = []
    pending = list(tickets)
    while pending:
        granted = [t for t in pending if t.granted]
        assert len(granted) == 1
        order.append(granted[0])
        pending.remove(granted[0])
        sched.release(granted[0], actual_cost=granted[0].cost)
    return order


async def test_vtc_interleaves_a_flooder_and_a_newcomer():
    sched = FairScheduler(capacity=1, max_queue=100)
    blocker = sched.submit("flood", 0, 10)
    flood = [sched.submit("flood", 0, 10) for _ in range(40)]
    light = [sched.submit("light", 0, 10) for _ in range(10)]
    sched.release(blocker, 10)
    order = await serve_in_order(sched, flood + light)
    first20 = [t.tenant_id for t in order[:20]]
    assert first20.count("light") == 10  # the newcomer gets half the service while both wait
    served = {"flood": 0, "light": 0}
    for t in order[: order.index(light[-1]) + 1]:
        served[t.tenant_id] += t.cost
    assert jain(list(served.values())) > 0.95


async def test_strict_priority_between_bands_and_bounded_queue():
    sched = FairScheduler(capacity=1, max_queue=5)
    running = sched.submit("low", 0, 1)
    low = [sched.submit("low", 0, 1) for _ in range(3)]
    high = sched.submit("vip", 5, 1)
    sched.submit("other", 0, 1)
    with pytest.raises(QueueFull):
        sched.submit("late", 0, 1)
    sched.release(running, 1)
    assert high.granted and not any(t.granted for t in low)


async def test_cancelled_waiter_leaves_the_queue():
    sched = FairScheduler(capacity=1, max_queue=5)
    running = sched.submit("a", 0, 1)
    waiter = sched.submit("b", 0, 1)
    task = asyncio.create_task(sched.wait(waiter))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sched.depth == 0
    sched.release(running)
    assert sched.inflight == 0


def test_flooding_tenant_does_not_starve_another_of_same_priority(own_tmp, capsys):
    tenants = write_tenants(own_tmp / "fairness-tenants.yaml", [
        {"id": "flood", "api_keys_sha256": [hash_key("k-flood")]},
        {"id": "light", "api_keys_sha256": [hash_key("k-light")]},
        {"id": "vip", "api_keys_sha256": [hash_key("k-vip")], "priority": 10},
    ])
    gw = InProcessGateway(tenants, GatewayConfig(capacity=2, max_queue=200))
    body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}
    try:
        async def scenario():
            done: list[tuple[float, str, int]] = []
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as http:
                async def one(key: str):
                    r = await http.post(gw.url + "/v1/completions", json=body, headers={"x-api-key": key})
                    assert r.status_code == 200, r.text
                    done.append((time.monotonic(), key, r.json()["usage"]["completion_tokens"]))

                flood = [asyncio.create_task(one("k-flood")) for _ in range(60)]
                deadline = time.monotonic() + 60
                while gw.gateway.scheduler.depth < 30:  # the flood is queued (capacity is 2)
                    assert time.monotonic() < deadline, "flood requests never queued"
                    await asyncio.sleep(0.005)
                light = [asyncio.create_task(one("k-light")) for _ in range(15)]
                while gw.gateway.scheduler.waiting_by_tenant().get("light", 0) < 15 and not any(
                        t.done() for t in light):
                    await asyncio.sleep(0.002)
                vip = asyncio.create_task(one("k-vip"))
                await asyncio.gather(*flood, *light, vip)
            return done

        done = asyncio.run(scenario())
    finally:
        gw.stop()
    done.sort()
    keys = [k for _, k, _ in done]
    # strict priority: the vip request overtakes everything still queued
    assert keys.index("k-vip") < 10
    # fairness: tokens served to each tenant while both were waiting
    last_light = max(i for i, k in enumerate(keys) if k == "k-light")
    served = {"k-flood": 0, "k-light": 0}
    for _, key, tokens in done[: last_light + 1]:
        if key in served:
            served[key] += tokens
    index = jain(list(served.values()))
    fifo_index = jain([60 * 24, 15 * 24])  # what first-come-first-served would give
    with capsys.disabled():
        print(f"\nfairness: tokens served while both waited {served}, Jain's index {index:.3f} "
              f"(FCFS would be {fifo_index:.3f})")
    assert index > 0.9
