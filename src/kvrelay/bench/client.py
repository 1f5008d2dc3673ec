"""One streamed request to an OpenAI-compatible server, timed on the client side.

aiohttp streams the response (its C parser keeps the client's own cost per event small: the
client shares the machine with the server it measures); every `data:` event with text is a
token increment. TTFT runs
from sending the request to the first increment with text, ITL is the gap between increments,
E2E runs to the end of the stream. A 429 is retried after the server's Retry-After (capped),
and the latency of a retried request still counts from its first attempt: what its user saw.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from dataclasses import dataclass, field

import aiohttp
import httpx


class ServerUnreachable(RuntimeError):
    """The server cannot be reached or refuses the benchmark's key or model: nothing to measure."""


@dataclass
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout_s: float = 600.0
    max_retries_429: int = 2
    max_retry_wait_s: float = 30.0
    connect_timeout_s: float = 10.0
    # --lora-modules: request k asks for models[k mod n] instead of model (LoRA adapters by name)
    models: tuple[str, ...] = ()
    # --random-images: chat requests carry this many random pictures of image_size (width, height)
    # as data URLs (vision-language models), request k's its own (the prefix cache cannot help).
    images: int = 0
    image_size: tuple[int, int] = (336, 336)

    def model_for(self, index: int) -> str:
        return self.models[index % len(self.models)] if self.models else self.model

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def embeddings(self) -> bool:
        """/v1/embeddings: one JSON answer per request, its latency standing for TTFT (as vLLM's bench)."""
        return self.endpoint.rstrip("/").endswith("embeddings")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")


@dataclass
class RequestResult:
    index: int  # order of sending within the run
    session: int
    turn: int
    tenant: str | None
    start: float  # seconds since the run began, when the first attempt was sent
    status: int | None = None  # final HTTP status; None: no response (transport error)
    error: str | None = None  # class: http_<status>, connect, timeout, disconnect, incomplete, stream_error
    error_detail: str = ""
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # the server's usage, else the client's tokenizer count
    output_tokens: int | None = None  # the server's usage, else the number of increments
    prompt_tokens_client: int | None = None  # counted with --tokenizer, when given
    usage_reported: bool = False
    attempts: int = 0
    rate_limited: int = 0  # 429 answers seen
    retry_after: list[float | None] = field(default_factory=list)  # each 429's advice (None: no header)
    retries_after_wait: int = 0  # retries sent after waiting the advised (capped) time
    text: str = ""  # the reply, kept for the next turn of a conversation (not written to files)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first one."""
        if not self.ok or self.ttft is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "text"}
        d["tpot"] = self.tpot
        return d


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After in seconds: delta-seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def random_image_url(seed: int, size: tuple[int, int]) -> str:
    """A random RGB picture as a PNG data URL."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def with_images(messages: list[dict], cfg: ClientConfig, index: int) -> list[dict]:
    """The last user message with cfg.images pictures after its text."""
    *head, last = messages
    parts = [{"type": "text", "text": last["content"]}] + [
        {"type": "image_url", "image_url": {"url": random_image_url(index * 1000 + k, cfg.image_size)}}
        for k in range(cfg.images)]
    return [*head, last | {"content": parts}]


def build_body(
    cfg: ClientConfig, prompt: str | None, messages: list[dict] | None, max_tokens: int | None,
    model: str | None = None, index: int = 0,
) -> dict:
    if cfg.embeddings:
        return {"model": model or cfg.model, "input": prompt, "encoding_format": "float"}
    body: dict = {
        "model": model or cfg.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": cfg.temperature,
    }
    if cfg.chat:
        body["messages"] = with_images(messages, cfg, index) if cfg.images else messages
    else:
        body["prompt"] = prompt
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


def _increment_text(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            text += choice.get("text") or ""
        else:
            delta = choice.get("delta") or {}
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return text


async def _attempt(
    http: aiohttp.ClientSession, cfg: ClientConfig, body: dict, headers: dict, r: RequestResult, t0: float
) -> aiohttp.ClientResponse | None:
    """One attempt; fills r's timings. Returns the response only when it is a 429."""
    r.attempts += 1
    last = None
    increments = 0
    try:
        async with http.post(cfg.url, json=body, headers=headers) as resp:
            r.status = resp.status
            if resp.status != 200:
                detail = (await resp.read())[:300].decode(errors="replace")
                r.error, r.error_detail = f"http_{resp.status}", detail
                return resp if resp.status == 429 else None
            if cfg.embeddings:
                usage = (await resp.json()).get("usage") or {}
                r.prompt_tokens, r.output_tokens = usage.get("prompt_tokens"), 0
                r.usage_reported, r.ttft = True, time.perf_counter() - t0
                r.e2e = r.ttft
                return None
            done = False
            async for raw in resp.content:
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # an error after the headers went out (OpenAI-style event)
                    r.error = "stream_error"
                    r.error_detail = json.dumps(chunk["error"])[:300]
                    return None
                if chunk.get("usage"):
                    r.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    r.output_tokens = chunk["usage"].get("completion_tokens")
                    r.usage_reported = True
                text = _increment_text(chunk)
                if text:
                    now = time.perf_counter()
                    if r.ttft is None:
                        r.ttft = now - t0
                    else:
                        r.itl.append(now - last)
                    last = now
                    increments += 1
                    r.text += text
            if not done:
                r.error, r.error_detail = "incomplete", "the stream ended without data: [DONE]"
                return None
    except aiohttp.ClientConnectorError as e:
        r.error, r.error_detail = "connect", str(e)
        return None
    except TimeoutError as e:  # aiohttp's timeouts are TimeoutErrors
        r.error, r.error_detail = "timeout", type(e).__name__
        return None
    except aiohttp.ClientError as e:  # payload cut short, server disconnected, connection reset
        r.error, r.error_detail = "disconnect", f"{type(e).__name__}: {e}"
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        r.error, r.error_detail = "stream_error", f"an event is not JSON: {e}"
        return None
    r.e2e = time.perf_counter() - t0
    if not r.usage_reported:
        r.output_tokens = increments
    return None


async def send(
    http: aiohttp.ClientSession,
    cfg: ClientConfig,
    r: RequestResult,
    prompt: str | None,
    messages: list[dict] | None,
    max_tokens: int | None,
    api_key: str | None,
    t_run: float,
) -> RequestResult:
    """Send one request (retrying 429s as advised) and fill r."""
    args = (cfg, prompt, messages, max_tokens, cfg.model_for(r.index), r.index)
    # Encoding pictures takes milliseconds: off the event loop that times the other requests' streams.
    body = await asyncio.to_thread(build_body, *args) if cfg.images else build_body(*args)
    key = api_key or cfg.api_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    r.start = t0 - t_run
    while True:
        r.error, r.status, r.ttft, r.itl, r.text = None, None, None, [], ""
        resp = await _attempt(http, cfg, body, headers, r, t0)
        if resp is None:
            break
        r.rate_limited += 1
        advice = parse_retry_after(resp.headers.get("retry-after"))
        r.retry_after.append(advice)
        if r.attempts > cfg.max_retries_429:
            break
        await asyncio.sleep(min(advice if advice is not None else 1.0, cfg.max_retry_wait_s))
        r.retries_after_wait += 1
    if not r.ok:
        r.e2e = None
    return r


def make_http_client(cfg: ClientConfig) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s, sock_connect=cfg.connect_timeout_s)
    # Concurrency is the load shape's business: no connection limit of aiohttp's own may cap it.
    return aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0), read_bufsize=2**20
    )  # one SSE event may be a long line


async def preflight(base_url: str, api_key: str | None, model: str | None, timeout_s: float = 10.0) -> str:
    """Fail fast on a dead server or a refused key; returns the model to ask for (the server's first
    one when none is given)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        try:
            resp = await http.get(url, headers=headers)
        except httpx.ConnectError as e:
            raise ServerUnreachable(
                f"cannot connect to {base_url}: {e or 'connection refused'}; is the server "
                "running, and is --base-url right?"
            ) from e
        except httpx.TimeoutException as e:
            raise ServerUnreachable(f"{url} did not answer within {timeout_s:g} s") from e
        except httpx.HTTPError as e:
            raise ServerUnreachable(f"{url}: {type(e).__name__}: {e}") from e
    if resp.status_code in (401, 403):
        raise ServerUnreachable(f"{url} answered {resp.status_code}: the API key was refused (--api-key)")
    if model:
        return model
    if resp.status_code != 200:
        raise ServerUnreachable(f"{url} answered {resp.status_code}; name the model with --model")
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ServerUnreachable(f"{url} lists no model; name one with --model") from e
