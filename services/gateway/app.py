"""The gateway's HTTP API (FastAPI): OpenAI-compatible completions and chat, health, metrics.

Request path: authenticate the tenant -> validate and tokenize -> reserve quota -> queue
for a slot -> generate on the backend -> stream or return the answer -> reconcile quota.
Everything before the queue answers with an HTTP error status; the wait for a slot and the
generation run inside `GenerationResponse`, which watches for the client going away and
then aborts the request upstream (freeing its KV blocks) and releases its quota and slot.
"""


import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from kvrelay.engine import logits_processors
from kvrelay.engine.errors import EngineDeadError, InvalidRequestError, PromptTooLongError
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.gateway import errors, hooks
from kvrelay.gateway.backend import Backend
from kvrelay.gateway.errors import ApiError
from kvrelay.gateway.metrics import GatewayMetrics
from kvrelay.gateway.quota import (
    Admission,
    MemoryQuotaStore,
    QuotaExceeded,
    QuotaManager,
    QuotaStoreUnavailable,
)
from kvrelay.gateway.scheduler import FairScheduler, QueueFull, Ticket
from kvrelay.gateway.schemas import (
    ERROR_RESPONSES,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
)
from kvrelay.gateway.tenants import Tenant, TenantRegistry, key_from_headers
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


@dataclass
class GatewayConfig:
    max_queue: int = 1024  # requests waiting for a slot; past it: 503
    capacity: int | None = None  # sequences in flight on the backend; None: the backend's own
    max_body_bytes: int = 2 * 1024 * 1024  # larger bodies: 413
    lease_ttl_s: float = 30.0  # concurrency leases of a dead gateway free after this
    quota_fail_open: bool = False  # Redis unreachable: False -> 503, True -> admit unaccounted
    max_tenant_labels: int = 100


@dataclass
class Prepared:
    """A validated request, ready for admission."""

    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    tenant: Tenant
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    reserve: int  # prompt tokens + max_tokens x n per prompt
    arrival: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))
    admission: Admission | None = None
    ticket: Ticket | None = None
    echo: list[str] | None = None  # completions with echo: each prompt's text, put before its choices' text


class Gateway:
    def __init__(self, backend: Backend, tenants: TenantRegistry | None = None,
                 quota: QuotaManager | None = None, config: GatewayConfig | None = None):
        self.backend = backend
        self.config = config or GatewayConfig()
        self.tenants = tenants or TenantRegistry(None)
        self.quota = quota or QuotaManager(MemoryQuotaStore(), self.config.lease_ttl_s, self.config.quota_fail_open)
        self.metrics = GatewayMetrics(self.config.max_tenant_labels)
        self.metrics.attach_gauges(self._gauges)
        self.scheduler: FairScheduler | None = None
        self.running = 0

    async def start(self) -> None:
        await self.backend.start()
        capacity = self.config.capacity or self.backend.capacity
        self.scheduler = FairScheduler(capacity, self.config.max_queue)

    async def shutdown(self) -> None:
        await self.backend.shutdown()
        await self.quota.close()

    def _gauges(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        if self.scheduler is None:
            return {}
        model = self.backend.model_name
        stats = self.backend.stats()
        depth = self.scheduler.depth
        # Requests waiting at the gateway need every role, so each role's series shows the queue.
        out = {
            "kvrelay:gateway_queue_depth": [({"model": model, "role": role}, depth) for role in self.backend.roles],
            "kvrelay:num_requests_waiting": [({"model": model}, depth + (stats.num_waiting if stats else 0))],
            "kvrelay:num_requests_running": [({"model": model}, stats.num_running if stats else self.running)],
        }
        if stats is not None:
            out["kvrelay:kv_cache_usage_perc"] = [({"model": model}, stats.kv_usage)]
        return out

    # ------------------------------------------------------------------ validation

    def check_model(self, model: str, tenant: Tenant) -> None:
        if model != self.backend.model_name:
            raise errors.model_not_found(model, [self.backend.model_name])
        if not tenant.may_use(model):
            raise errors.forbidden(f"Tenant {tenant.id!r} may not use model {model!r}", "model")

    def _params(self, body, max_tokens: int | None, max_tokens_field: str, logprobs: int | None) -> SamplingParams:
        defaults = self.backend.default_sampling_params()
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        for s in stop:
            _check_text(s, "stop")
        params = SamplingParams(
            n=body.n, max_tokens=max_tokens, min_tokens=body.min_tokens,
            temperature=defaults.temperature if body.temperature is None else float(body.temperature),
            top_p=defaults.top_p if body.top_p is None else float(body.top_p),
            top_k=defaults.top_k if body.top_k is None else body.top_k,
            min_p=defaults.min_p if body.min_p is None else float(body.min_p),
            repetition_penalty=(defaults.repetition_penalty if body.repetition_penalty is None
                                else float(body.repetition_penalty)),
            presence_penalty=float(body.presence_penalty), frequency_penalty=float(body.frequency_penalty),
            # The engine seeds a 64-bit generator: fold any integer into its range, deterministically.
            seed=None if body.seed is None else body.seed % (2**63),
            stop=stop, ignore_eos=body.ignore_eos, logprobs=logprobs, logit_bias=_logit_bias(body.logit_bias),
            logits_processors=logits_processors.normalise(body.logits_processors),
        )
        try:
            params.validate(self.backend.tokenizer.vocab_size)
        except InvalidRequestError as e:
            param = max_tokens_field if e.field == "max_tokens" else e.field
            raise errors.bad_request(str(e), param) from e
        return params

    def _fit_context(self, prompts: list[list[int]], params: SamplingParams, field_name: str) -> int:
        """Check every prompt fits the context with max_tokens; fill max_tokens when absent."""
        limit = self.backend.max_model_len
        longest = max(len(p) for p in prompts)
        if params.max_tokens is None:
            if longest >= limit:
                raise ApiError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                               f"{longest}, which leaves no room to generate", param=field_name,
                               code="context_length_exceeded")
            params.max_tokens = limit - longest
        elif longest + params.max_tokens > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens; the request asks for "
                           f"{longest + params.max_tokens} ({longest} in the prompt, {params.max_tokens} to "
                           "generate): shorten the prompt or lower max_tokens", param=field_name,
                           code="context_length_exceeded")
        return sum(len(p) + params.n * params.max_tokens for p in prompts)

    def _encode(self, text: str, field_name: str) -> list[int]:
        _check_text(text, field_name)
        tok = self.backend.tokenizer
        encode = getattr(tok, "encode_prompt", None)
        return encode(text) if encode else tok.encode(text)

    def prepare_completion(self, body: CompletionRequest, tenant: Tenant) -> Prepared:
        self.check_model(body.model, tenant)
        if body.user is not None:
            _check_text(body.user, "user")
        raw = body.prompt
        if isinstance(raw, str):
            prompts = [self._encode(raw, "prompt")]
        elif all(isinstance(x, int) for x in raw):
            prompts = [list(raw)]
        elif all(isinstance(x, str) for x in raw):
            prompts = [self._encode(x, "prompt") for x in raw]
        else:
            prompts = [list(x) for x in raw]
        vocab = self.backend.tokenizer.vocab_size
        if any(t >= vocab for p in prompts for t in p):
            raise errors.bad_request(f"prompt: token ids must be < the vocabulary size {vocab}", "prompt")
        if body.echo and body.logprobs is not None:
            raise errors.bad_request("echo: not supported together with logprobs (prompt logprobs are not "
                                     "computed)", "echo")
        params = self._params(body, body.max_tokens, "max_tokens", body.logprobs)
        reserve = self._fit_context(prompts, params, "prompt")
        p = Prepared("completion", f"cmpl-{uuid.uuid4().hex}", body.model, tenant, prompts, params,
                     body.stream, bool(body.stream_options and body.stream_options.include_usage),
                     body.logprobs is not None, reserve)
        if body.echo:
            if isinstance(raw, str):
                p.echo = [raw]
            elif isinstance(raw[0], str):
                p.echo = list(raw)
            else:  # token ids
                p.echo = [self.backend.tokenizer.decode(ids) for ids in prompts]
        return p

    def prepare_chat(self, body: ChatCompletionRequest, tenant: Tenant) -> Prepared:
        self.check_model(body.model, tenant)
        if body.user is not None:
            _check_text(body.user, "user")
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
            _check_text(content, f"messages[{i}].content")
            messages.append({"role": m.role, "content": content} | ({"name": m.name} if m.name else {}))
        try:
            text = self.backend.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except InvalidRequestError as e:
            raise errors.bad_request(str(e), "messages") from e
        prompts = [self._encode(text, "messages")]
        if body.top_logprobs is not None and not body.logprobs:
            raise errors.bad_request("top_logprobs: requires `logprobs: true`", "top_logprobs")
        field_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._params(body, max_tokens, field_name, logprobs)
        reserve = self._fit_context(prompts, params, "messages")
        return Prepared("chat", f"chatcmpl-{uuid.uuid4().hex}", body.model, tenant, prompts, params,
                        body.stream, bool(body.stream_options and body.stream_options.include_usage),
                        body.logprobs, reserve)

    # ------------------------------------------------------------------ admission

    async def admit(self, p: Prepared) -> None:
        """Reserve quota and a place in the queue, or raise the ApiError that says why not."""
        if self.scheduler is None or not self.backend.ready():
            raise errors.unavailable("No healthy workers are serving this model right now", "no_healthy_workers")
        q = p.tenant.quotas
        for name, limit in (("tokens_per_minute", q.tokens_per_minute), ("tokens_per_day", q.tokens_per_day)):
            if limit is not None and p.reserve > limit:
                raise errors.bad_request(
                    f"This request needs {p.reserve} tokens (prompt + max_tokens x n) but tenant "
                    f"{p.tenant.id!r} has a {name} quota of {limit}: lower max_tokens or n", "max_tokens",
                    "request_exceeds_quota")
        try:
            p.admission = await self.quota.admit(p.tenant.id, q, p.request_id, p.reserve)
        except QuotaExceeded as e:
            self.metrics.quota_rejections.labels(self.metrics.tenant(p.tenant.id), e.limit).inc()
            raise errors.rate_limited(
                f"Rate limit reached for tenant {p.tenant.id!r}: {e.limit} quota exhausted; retry after "
                f"{e.headers.get('Retry-After', '1')} s", e.limit, e.headers) from e
        except QuotaStoreUnavailable as e:
            log.error("%s", e)
            raise errors.unavailable("The quota store is unavailable; retry shortly", "quota_store_unavailable") from e
        try:
            p.ticket = self.scheduler.submit(p.tenant.id, p.tenant.priority, p.reserve,
                                             slots=p.params.n * len(p.prompts))
        except QueueFull as e:
            await self.quota.complete(p.admission, 0)
            raise errors.unavailable(f"The gateway is saturated: {e}", "queue_full") from e

    # ------------------------------------------------------------------ generation

    def stream_outputs(self, p: Prepared):
        """(prompt index, RequestOutput) for every prompt of the request, interleaved."""
        if len(p.prompts) == 1:
            return _single(self.backend, p.prompts[0], p.params, p.request_id, p.tenant.priority)
        return _merged(self.backend, p)


async def _single(backend, prompt, params, request_id, priority):
    gen = backend.generate(prompt, params, request_id, priority)
    try:
        async for out in gen:
            yield 0, out
    finally:
        await gen.aclose()


async def _merged(backend, p: Prepared):
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, prompt: list[int]) -> None:
        gen = backend.generate(prompt, p.params, f"{p.request_id}-{i}", p.tenant.priority)
        try:
            async for out in gen:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, e))
        finally:
            await gen.aclose()

    tasks = [asyncio.create_task(pump(i, prompt)) for i, prompt in enumerate(p.prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's string keys as token ids; SamplingParams.validate checks them against the vocab."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise errors.bad_request(f"logit_bias: keys must be token ids, got {key[:32]!r}", "logit_bias")
        out[int(key)] = float(value)
    return out


def _token_text(tok, token_id: int) -> str:
    """A token's text with its leading space (decoding one token alone drops a SentencePiece "▁")."""
    piece = tok.id_to_token(token_id) if hasattr(tok, "id_to_token") else None
    if piece and "\u2581" in piece and not piece.startswith("<"):
        return piece.replace("\u2581", " ")
    return tok.decode([token_id])


def _check_text(text: str, field_name: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise errors.bad_request(f"{field_name}: contains invalid Unicode (a lone surrogate at {e.start})",
                                 field_name) from e


def _engine_error(e: Exception, p: Prepared) -> ApiError:
    if isinstance(e, PromptTooLongError):
        return ApiError(400, str(e), param="messages" if p.kind == "chat" else "prompt",
                        code="context_length_exceeded")
    if isinstance(e, InvalidRequestError):
        return errors.bad_request(str(e), e.field)
    if isinstance(e, EngineDeadError):
        return errors.unavailable(f"The engine stopped: {e}", "engine_dead")
    if type(e).__module__ == "kvrelay.kvtransfer.errors":  # worker unreachable, no capacity, failed hand-off
        return errors.unavailable(f"No worker could serve the request: {e}", "workers_unavailable")
    log.exception("request %s failed", p.request_id, exc_info=e)
    return ApiError(500, f"Internal error while generating ({type(e).__name__})", "server_error",
                    code="internal_error")


def _sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    length: int = 0  # characters so far (completions' text_offset)
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top: list[dict] = field(default_factory=list)
    chat_logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    generated: int = 0
    started: bool = False


class GenerationResponse(Response):
    """Waits for a slot, generates, and answers; a client disconnect aborts it upstream."""

    def __init__(self, gateway: Gateway, prepared: Prepared):
        super().__init__()
        self.gw = gateway
        self.p = prepared
        self.choices: dict[int, _Choice] = {}
        self.headers_sent = False
        self.last_token_at: float | None = None
        self._itl = gateway.metrics.itl.labels(prepared.model)  # observed per token: bind the labels once

    async def __call__(self, scope, receive, send) -> None:
        main = asyncio.create_task(self._run(send))
        watcher = asyncio.create_task(_wait_disconnect(receive))
        try:
            await asyncio.wait({main, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (main, watcher):
                task.cancel()
            await asyncio.gather(main, watcher, return_exceptions=True)

    # -- the request's life after admission

    async def _run(self, send) -> None:
        gw, p = self.gw, self.p
        outputs = None
        try:
            await gw.scheduler.wait(p.ticket)
            gw.metrics.queue_time.labels(p.model).observe(time.monotonic() - p.arrival)
            gw.running += 1
            outputs = gw.stream_outputs(p)
            if p.stream:
                await self._stream(outputs, send)
            else:
                async for i, out in outputs:
                    self._absorb(i, out)
                await self._send_json(200, self._final_body(), send)
        except ApiError as e:
            await self._fail(e, send)
        except (InvalidRequestError, EngineDeadError) as e:
            await self._fail(_engine_error(e, p), send)
        except OSError:
            pass  # the client went away while we were sending
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a request must not take the server down
            await self._fail(_engine_error(e, p), send)
        finally:
            if outputs is not None:
                await outputs.aclose()
                gw.running -= 1
            await self._finish()

    async def _finish(self) -> None:
        gw, p = self.gw, self.p
        generated = sum(c.generated for c in self.choices.values())
        prompt_tokens = sum(len(x) for x in p.prompts)
        used = prompt_tokens + generated
        if p.ticket is not None:
            gw.scheduler.release(p.ticket, actual_cost=used)
        if p.admission is not None:
            await gw.quota.complete(p.admission, used)
        m, tenant = gw.metrics, gw.metrics.tenant(p.tenant.id)
        m.prompt_tokens.labels(p.model, tenant).inc(prompt_tokens)
        m.generation_tokens.labels(p.model, tenant).inc(generated)
        reasons = {c.finish_reason or "abort" for c in self.choices.values()} or {"abort"}
        for reason in reasons:
            m.requests.labels(p.model, tenant, reason).inc()
        m.e2e.labels(p.model).observe(time.monotonic() - p.arrival)

    async def _fail(self, e: ApiError, send) -> None:
        self.gw.metrics.errors.labels(str(e.status)).inc()
        if not self.headers_sent:
            await self._send_json(e.status, e.body(), send, e.headers)
        else:  # mid-stream: OpenAI-style error event, then close the stream
            await send({"type": "http.response.body", "body": _sse(e.body()), "more_body": True})
            await send({"type": "http.response.body", "body": _sse("[DONE]"), "more_body": False})

    async def _send_json(self, status: int, body: dict, send, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        all_headers = {**self._extra_headers(), **(headers or {})}
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in all_headers.items()]
        self.headers_sent = True
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": data})

    def _extra_headers(self) -> dict[str, str]:
        h = {"x-request-id": self.p.request_id}
        if self.p.admission is not None:
            h.update(self.p.admission.headers)
        return h

    async def _stream(self, outputs, send) -> None:
        p = self.p
        first = await outputs.__anext__()  # engine errors before the first token become HTTP statuses
        raw = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
        raw += [(k.lower().encode(), v.encode()) for k, v in self._extra_headers().items()]
        self.headers_sent = True
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        pending = [first]
        while True:
            for i, out in pending:
                for chunk in self._chunks(i, out):
                    await send({"type": "http.response.body", "body": _sse(chunk), "more_body": True})
            try:
                pending = [await outputs.__anext__()]
            except StopAsyncIteration:
                break
        if p.include_usage:
            await send({"type": "http.response.body", "body": _sse(self._chunk_base() | {
                "choices": [], "usage": self._usage()}), "more_body": True})
        await send({"type": "http.response.body", "body": _sse("[DONE]"), "more_body": False})

    # -- turning engine outputs into OpenAI shapes

    def _absorb(self, i: int, out) -> tuple[int, _Choice, dict | None]:
        """Record one increment; returns (choice index, state, this increment's logprobs)."""
        p, tok = self.p, self.gw.backend.tokenizer
        index = i * p.params.n + out.index
        c = self.choices.setdefault(index, _Choice())
        now = time.monotonic()
        if out.new_token_ids:
            if self.last_token_at is None:
                self.gw.metrics.ttft.labels(p.model).observe(now - p.arrival)
            else:
                self._itl.observe(now - self.last_token_at)
            self.last_token_at = now
        c.started = c.started or bool(out.new_token_ids)
        c.generated = out.num_generated_tokens
        c.finish_reason = out.finish_reason or c.finish_reason
        c.text.append(out.text)
        delta_lp = None
        if p.logprobs and out.logprobs:
            if p.kind == "completion":
                delta_lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                offset = c.length
                for lp in out.logprobs:
                    token = _token_text(tok, lp.token_id)
                    top = {_token_text(tok, t): v for t, v in lp.top}
                    for key, value in (("tokens", token), ("token_logprobs", lp.logprob),
                                       ("top_logprobs", top), ("text_offset", offset)):
                        delta_lp[key].append(value)
                    offset += len(token)
                c.tokens += delta_lp["tokens"]
                c.token_logprobs += delta_lp["token_logprobs"]
                c.top += delta_lp["top_logprobs"]
            else:
                content = []
                for lp in out.logprobs:
                    token = _token_text(tok, lp.token_id)
                    content.append({"token": token, "logprob": lp.logprob, "bytes": list(token.encode()),
                                    "top_logprobs": [{"token": (t := _token_text(tok, tid)), "logprob": v,
                                                      "bytes": list(t.encode())} for tid, v in lp.top]})
                c.chat_logprobs += content
                delta_lp = {"content": content}
        c.length += len(out.text)
        return index, c, delta_lp

    def _chunk_base(self) -> dict:
        p = self.p
        obj = "text_completion" if p.kind == "completion" else "chat.completion.chunk"
        return {"id": p.request_id, "object": obj, "created": p.created, "model": p.model}

    def _chunks(self, i: int, out) -> list[dict]:
        p = self.p
        first_of_choice = (i * p.params.n + out.index) not in self.choices
        index, _, delta_lp = self._absorb(i, out)
        usage = {"usage": None} if p.include_usage else {}
        if p.kind == "completion":
            text = p.echo[i] + out.text if p.echo and first_of_choice else out.text
            choice = {"index": index, "text": text, "logprobs": delta_lp, "finish_reason": out.finish_reason}
            return [self._chunk_base() | {"choices": [choice]} | usage]
        chunks = []
        if first_of_choice:
            chunks.append(self._chunk_base() | {"choices": [{"index": index, "delta": {
                "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]} | usage)
        if out.text or delta_lp or out.finish_reason:
            delta = {"content": out.text} if out.text else {}
            chunks.append(self._chunk_base() | {"choices": [{"index": index, "delta": delta, "logprobs": delta_lp,
                                                             "finish_reason": out.finish_reason}]} | usage)
        return chunks

    def _usage(self) -> dict:
        prompt = sum(len(x) for x in self.p.prompts)
        completion = sum(c.generated for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _final_body(self) -> dict:
        p = self.p
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            text = "".join(c.text)
            if p.echo:
                text = p.echo[index // p.params.n] + text
            if p.kind == "completion":
                lp = None
                if p.logprobs:
                    offsets, pos = [], 0
                    for t in c.tokens:
                        offsets.append(pos)
                        pos += len(t)
                    lp = {"tokens": c.tokens, "token_logprobs": c.token_logprobs, "top_logprobs": c.top,
                          "text_offset": offsets}
                choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": {"content": c.chat_logprobs} if p.logprobs else None,
                                "finish_reason": c.finish_reason})
        obj = "text_completion" if p.kind == "completion" else "chat.completion"
        return {"id": p.request_id, "object": obj, "created": p.created, "model": p.model,
                "choices": choices, "usage": self._usage()}


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class BodyLimit:
    """ASGI middleware: bodies over `max_bytes` get a 413 before any handler runs."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = errors.too_large(f"Request body exceeds the limit of {self.max_bytes} bytes")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await too_large.response()(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await too_large.response()(scope, receive, send)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _validation_error(exc: RequestValidationError) -> ApiError:
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return errors.bad_request(f"The request body is not valid JSON: {first.get('msg')}", None, "invalid_json")
    # Union members add their type names to the location (`prompt.str`): keep the field path.
    path = []
    for part in loc:
        if part.isdigit():
            path.append(f"[{part}]")
        elif part[0].isupper() or "[" in part or part in ("str", "int", "float", "bool", "list", "dict") or \
                part.startswith(("list[", "function-", "constrained-")):
            continue
        else:
            path.append(("." if path else "") + part)
    param = "".join(path) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        msg = "unknown field (not part of this API)"
    more = f" ({len(errs) - 1} more errors)" if len(errs) > 1 else ""
    return errors.bad_request(f"{param or 'body'}: {msg}{more}", param, "invalid_value")


def create_app(gateway: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.shutdown()

    app = FastAPI(title="kvrelay gateway", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions and chat with tenant quotas and fair queueing.")
    app.state.gateway = gateway
    hooks.install(app, gateway.metrics.registry, gateway.config.max_body_bytes)  # plugin request/response hooks

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        gateway.metrics.errors.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        gateway.metrics.errors.labels("400").inc()
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        gateway.metrics.errors.labels(str(exc.status_code)).inc()
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        gateway.metrics.errors.labels("500").inc()
        return ApiError(500, "Internal server error", "server_error", code="internal_error").response()

    async def tenant_of(request: Request) -> Tenant:  # async: sync dependencies hop to a thread pool
        tenant = gateway.tenants.authenticate(key_from_headers(request.headers))
        if tenant is None:
            raise errors.unauthorized("Missing or incorrect API key: send it as `Authorization: Bearer <key>` "
                                      "or in an `x-api-key` header")
        return tenant

    gen_responses = {200: {"description": "A completion; `text/event-stream` of chunks when `stream` is true",
                           "content": {"text/event-stream": {}}}} | ERROR_RESPONSES

    @app.post("/v1/completions", response_model=CompletionResponse, responses=gen_responses)
    async def completions(body: CompletionRequest, tenant: Annotated[Tenant, Depends(tenant_of)]):
        prepared = gateway.prepare_completion(body, tenant)
        await gateway.admit(prepared)
        return GenerationResponse(gateway, prepared)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=gen_responses)
    async def chat_completions(body: ChatCompletionRequest, tenant: Annotated[Tenant, Depends(tenant_of)]):
        prepared = gateway.prepare_chat(body, tenant)
        await gateway.admit(prepared)
        return GenerationResponse(gateway, prepared)

    @app.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
    async def models(tenant: Annotated[Tenant, Depends(tenant_of)]):
        name = gateway.backend.model_name
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "kvrelay",
                 "max_model_len": gateway.backend.max_model_len}] if tenant.may_use(name) else []
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready", responses={503: ERROR_RESPONSES[503]})
    async def ready():
        if not gateway.backend.ready():
            raise errors.unavailable("No healthy workers", "no_healthy_workers")
        return {"status": "ready", "model": gateway.backend.model_name}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics():
        return Response(gateway.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_middleware(BodyLimit, max_bytes=gateway.config.max_body_bytes)
    return app

