"""The tokenizer pool's bound: past `tokenizer_queue` waiting preparations a request gets 503
tokenizer_busy and nothing else is lost; short plain prompts are prepared on the event loop, so
they are served even while the pool is saturated."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from gateway_helpers import InProcessGateway
from kvrelay.gateway.app import GatewayConfig
from kvrelay.gateway.gateway import INLINE_PROMPT_CHARS

MODEL = "stories260K"
LONG = "Once upon a time there was a little girl who loved to play. " * 6
SHORT = "Once upon a time"


@pytest.fixture(scope="module")
def gw():
    g = InProcessGateway(config=GatewayConfig(tokenizer_threads=1, tokenizer_queue=1))
    yield g
    g.stop()


def _post(gw, prompt: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    return httpx.post(gw.url + "/v1/completions", json=body, timeout=60)


def _until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_a_full_tokenizer_queue_is_a_503_and_short_prompts_still_pass(gw):
    assert len(LONG) > INLINE_PROMPT_CHARS >= len(SHORT)
    gateway = gw.gateway
    release = threading.Event()
    blocker = gateway._executor.submit(release.wait, 60)  # the pool's one thread is busy
    with ThreadPoolExecutor(2) as clients:
        try:
            first = clients.submit(_post, gw, LONG)  # holds the one slot, queued behind the blocker
            _until(lambda: gateway._prepare_slots.locked(), "the first request to take the slot")
            second = clients.submit(_post, gw, LONG)  # waits for the slot: the queue (1) is full
            _until(lambda: gateway._prepare_waiting == 1, "the second request to wait")

            r = _post(gw, LONG)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "tokenizer_busy"
            short = _post(gw, SHORT)  # prepared inline: the saturated pool is not in its way
            assert short.status_code == 200, short.text
            assert short.json()["usage"]["completion_tokens"] == 2
        finally:
            release.set()
        blocker.result(timeout=60)
        for f in (first, second):  # the queued requests were kept, and finish once the pool frees
            r = f.result(timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 2
    _until(lambda: gateway._prepare_waiting == 0 and not gateway._prepare_slots.locked(), "the pool to drain")
    assert _post(gw, LONG).status_code == 200
