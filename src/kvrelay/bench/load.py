"""Load shapes: when each request is sent, how many run at once, which tenant sends it.

Arrivals are open loop: session i starts at its arrival time whatever earlier requests are doing,
with gaps drawn from a gamma distribution of mean 1/rate (shape 1 = Poisson; below 1 burstier,
above 1 more regular), or all at once for an infinite rate. --max-concurrency caps the requests
in flight. A conversation's turns follow each other: turn k+1 is sent when turn k's reply is in.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from kvrelay.bench.client import ClientConfig, RequestResult, send
from kvrelay.bench.datasets import Session


@dataclass
class Tenant:
    name: str
    api_key: str
    weight: float = 1.0


def parse_tenant(text: str) -> Tenant:
    """NAME:KEY[:WEIGHT]"""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
        raise ValueError(f"--tenant {text!r}: expected NAME:API_KEY[:WEIGHT]")
    weight = 1.0
    if len(parts) == 3:
        try:
            weight = float(parts[2])
        except ValueError:
            raise ValueError(f"--tenant {text!r}: the weight {parts[2]!r} is not a number") from None
        if weight <= 0:
            raise ValueError(f"--tenant {text!r}: the weight must be positive")
    return Tenant(parts[0], parts[1], weight)


@dataclass
class LoadShape:
    request_rate: float = math.inf  # sessions started per second
    burstiness: float = 1.0  # gamma shape of the gaps; 1: Poisson arrivals
    max_concurrency: int | None = None

    def label(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        conc = "" if self.max_concurrency is None else f" c={self.max_concurrency}"
        return f"{rate}/s{conc}"


def arrival_gaps(shape: LoadShape, rng: np.random.Generator):
    """Endless gaps (s) between session starts."""
    if shape.burstiness <= 0:
        raise ValueError("--burstiness: must be positive")
    while True:
        if math.isinf(shape.request_rate):
            yield 0.0
        else:
            theta = 1.0 / (shape.request_rate * shape.burstiness)
            yield float(rng.gamma(shape.burstiness, theta))


def render(
    session: Session, turn: int, history: list[dict], chat: bool
) -> tuple[str | None, list[dict] | None]:
    """(prompt, messages) of a session's turn: chat messages, or the same as plain text."""
    messages = ([{"role": "system", "content": session.system}] if session.system else []) + history
    messages.append({"role": "user", "content": session.turns[turn].text})
    if chat:
        return None, messages
    if len(messages) == 1:
        return messages[0]["content"], None
    if session.system and len(messages) == 2:
        return f"{session.system}\n{session.turns[turn].text}", None
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:", None


def count_tokens(tokenizer, prompt: str | None, messages: list[dict] | None) -> int | None:
    if tokenizer is None:
        return None
    if messages is not None:
        prompt = tokenizer.apply_chat_template(messages)
    return len(tokenizer.encode_prompt(prompt))


@dataclass
class Run:
    """One load level's results (a sweep holds several)."""

    shape: LoadShape
    results: list[RequestResult] = field(default_factory=list)
    started: float = 0.0  # perf_counter at the first send
    duration_s: float = 0.0
    sent: int = 0


@dataclass
class Workload:
    sessions: list[Session]
    client: ClientConfig
    tenants: list[Tenant] = field(default_factory=list)
    tokenizer: object = None
    seed: int = 0


async def run_load(
    http: aiohttp.ClientSession,
    work: Workload,
    shape: LoadShape,
    num_sessions: int | None,
    duration_s: float | None,
    on_done: Callable[[RequestResult], None] | None = None,
    run: Run | None = None,
) -> Run:
    """Send sessions (cycling through the dataset) until num_sessions are sent or duration_s has
    passed, then wait for the requests in flight. Results are appended to run.results as they end."""
    run = run or Run(shape)
    rng = np.random.default_rng(work.seed)
    tenant_rng = np.random.default_rng(work.seed + 1)
    weights = np.array([t.weight for t in work.tenants], dtype=float)
    limit = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    run.started = time.perf_counter()
    deadline = None if duration_s is None else run.started + duration_s
    counter = iter(range(1 << 62))

    def in_time() -> bool:
        return deadline is None or time.perf_counter() < deadline

    if deadline is not None and math.isinf(shape.request_rate) and limit is None:
        raise ValueError(
            "--duration/--soak: give a finite --request-rate or a --max-concurrency; "
            "an infinite rate with no limit would start sessions without end"
        )

    async def one(session: Session, tenant: Tenant | None) -> None:
        """The session's turns in order (with a limit, the first turn's slot is already taken)."""
        history: list[dict] = []
        for turn in range(len(session.turns)):
            if turn and not in_time():
                return
            prompt, messages = render(session, turn, history, work.client.chat)
            r = RequestResult(
                index=next(counter),
                session=session.index,
                turn=turn,
                tenant=tenant.name if tenant else None,
                start=0.0,
            )
            r.prompt_tokens_client = count_tokens(work.tokenizer, prompt, messages)
            if limit and turn:
                await limit.acquire()
            try:
                await send(
                    http,
                    work.client,
                    r,
                    prompt,
                    messages,
                    session.turns[turn].output_len,
                    tenant.api_key if tenant else None,
                    run.started,
                )
            finally:
                if limit:
                    limit.release()
            if r.prompt_tokens is None:
                r.prompt_tokens = r.prompt_tokens_client
            run.results.append(r)
            if on_done:
                on_done(r)
            if not r.ok:
                return  # a conversation cannot go on without the reply
            history += [
                {"role": "user", "content": session.turns[turn].text},
                {"role": "assistant", "content": r.text},
            ]

    tasks = []
    gaps = arrival_gaps(shape, rng)
    next_at = run.started
    i = 0
    while (num_sessions is None or i < num_sessions) and in_time():
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(
                delay if deadline is None else min(delay, max(0.0, deadline - time.perf_counter()))
            )
            if not in_time():
                break
        if limit:
            # An arrival waits here for a free slot (the requests go out in the same order and at
            # the same moments as with a queue of waiting tasks, without an unbounded backlog).
            await limit.acquire()
            if not in_time():
                limit.release()
                break
        tenant = (
            work.tenants[tenant_rng.choice(len(work.tenants), p=weights / weights.sum())]
            if work.tenants
            else None
        )
        tasks.append(asyncio.create_task(one(work.sessions[i % len(work.sessions)], tenant)))
        run.sent += 1
        i += 1
        next_at += next(gaps)
        if delay <= 0 and i % 64 == 0:
            await asyncio.sleep(0)  # let the first requests go out while a burst is being created
    await asyncio.gather(*tasks)
    run.duration_s = time.perf_counter() - run.started
    return run


async def warm_up(
    http: aiohttp.ClientSession, work: Workload, count: int, concurrency: int | None
) -> list[RequestResult]:
    """count requests that are not measured (first connections, lazy allocations, JIT)."""
    if count <= 0:
        return []
    run = await run_load(http, work, LoadShape(max_concurrency=concurrency or count), count, None)
    return run.results
