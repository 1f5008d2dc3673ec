"""The life of an admitted request: wait for a slot, generate, answer in OpenAI's shapes.

`GenerationResponse` watches for the client going away and then aborts the request upstream
(freeing its KV blocks) and releases its quota and slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from json.encoder import encode_basestring

from fastapi.responses import Response
from kvrelay.engine.errors import EngineDeadError, InvalidRequestError, PromptTooLongError
from kvrelay.gateway import errors
from kvrelay.gateway.access_log import access_fields
from kvrelay.gateway.deadlines import DEADLINE, deadline_exceeded
from kvrelay.gateway.errors import ApiError
from kvrelay.gateway.gateway import Gateway, Prepared
from kvrelay.gateway.prompt_logprobs import echo_lists, vllm_lists

log = logging.getLogger(__name__)


def _token_text(tok, token_id: int) -> str:
    """A token's text with its leading space (decoding one token alone drops a SentencePiece "▁")."""
    piece = tok.id_to_token(token_id) if hasattr(tok, "id_to_token") else None
    if piece and "\u2581" in piece and not piece.startswith("<"):
        return piece.replace("\u2581", " ")
    return tok.decode([token_id])


def _engine_error(e: Exception, p: Prepared) -> ApiError:
    if isinstance(e, PromptTooLongError):
        return ApiError(400, str(e), param="messages" if p.kind == "chat" else "prompt",
                        code="context_length_exceeded")
    if isinstance(e, InvalidRequestError):
        return errors.bad_request(str(e), e.field)
    if isinstance(e, EngineDeadError):
        return errors.unavailable(f"The engine stopped: {e}", "engine_dead")
    if type(e).__name__ == "DeadlineExceededError":  # a worker saw the deadline pass first
        return deadline_exceeded(p.timeout_s or 0)
    if type(e).__module__ == "kvrelay.kvtransfer.errors":  # worker unreachable, no capacity, failed hand-off
        return errors.unavailable(f"No worker could serve the request: {e}", "workers_unavailable")
    log.exception("request %s failed", p.request_id, exc_info=e)
    return ApiError(500, f"Internal error while generating ({type(e).__name__})", "server_error",
                    code="internal_error")


# json.dumps(obj, ensure_ascii=False, separators=(",", ":")), without building an encoder per call
_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _flat_json(obj: dict) -> str:
    """_json(obj), faster for the dicts of str, int, None (and such dicts) that most chunks' choices are:
    the same bytes (json renders a str with encode_basestring and an int with int.__repr__); anything
    else is left to the encoder."""
    parts = []
    for key, value in obj.items():
        kind = type(value)
        if type(key) is not str:
            return _json(obj)
        if value is None:
            parts.append(f"{encode_basestring(key)}:null")
        elif kind is str:
            parts.append(f"{encode_basestring(key)}:{encode_basestring(value)}")
        elif kind is int:
            parts.append(f"{encode_basestring(key)}:{int.__repr__(value)}")
        elif kind is dict:
            parts.append(f"{encode_basestring(key)}:{_flat_json(value)}")
        else:
            return _json(obj)
    return "{" + ",".join(parts) + "}"


def _sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else _json(obj)
    return f"data: {data}\n\n".encode()


def _body(data: bytes, more: bool = True) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    length: int = 0  # characters so far (completions' text_offset)
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top: list[dict] = field(default_factory=list)
    chat_logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    generated: int = 0


class GenerationResponse(Response):
    """Waits for a slot, generates, and answers; a client disconnect aborts it upstream."""

    def __init__(self, gateway: Gateway, prepared: Prepared):
        super().__init__()
        self.gw = gateway
        self.p = prepared
        self.choices: dict[int, _Choice] = {}
        self.cached: dict[int, int] = {}  # prompt index -> its tokens served by the prefix cache
        self.prompt_lps: dict[int, list] = {}  # prompt index -> its prompt logprobs (sample 0 brings them)
        self.headers_sent = False
        self.last_token_at: float | None = None
        self._itl = gateway.metrics.itl.labels(prepared.model)  # observed per token: bind the labels once
        self._prompt_tokens = sum(len(x) for x in prepared.prompts)
        self._generated = 0  # tokens generated so far, all choices
        self._event_ends: tuple[str, str] | None = None  # a chunk's JSON around its choices (_event)
        self.access: dict = {}  # this request's access-line fields (access_log.py), bound in __call__

    async def __call__(self, scope, receive, send) -> None:
        p = self.p
        self.access = access_fields(scope)
        self.access.update(tenant=p.tenant.id, model=p.model)
        p.timeout_s = timeout = self.gw.request_timeout(p.tenant)
        left = None if timeout is None else p.arrival + timeout - time.monotonic()
        DEADLINE.set(None if timeout is None else p.arrival + timeout)  # copied into the task below
        main = asyncio.create_task(self._run(send))
        watcher = asyncio.create_task(_wait_disconnect(receive))
        timed_out = False
        try:
            await asyncio.wait({main, watcher}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            timed_out = not main.done() and not watcher.done()
        finally:
            for task in (main, watcher):
                task.cancel()
            await asyncio.gather(main, watcher, return_exceptions=True)
        if timed_out:  # the cancel closed the backend iterator: the request was aborted upstream
            with contextlib.suppress(OSError):
                await self._fail(deadline_exceeded(timeout), send)

    # -- the request's life after admission

    async def _run(self, send) -> None:
        gw, p = self.gw, self.p
        outputs = None
        try:
            await gw.scheduler.wait(p.ticket)
            self.access["queue_s"] = time.monotonic() - p.arrival
            gw.metrics.queue_time.labels(p.model).observe(self.access["queue_s"])
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
        self.access.update(prompt_tokens=prompt_tokens, completion_tokens=generated)

    async def _fail(self, e: ApiError, send) -> None:
        self.gw.metrics.errors.labels(str(e.status)).inc()
        if not self.headers_sent:
            await self._send_json(e.status, e.body(), send, e.headers)
        else:  # mid-stream: OpenAI-style error event, then close the stream
            await send(_body(_sse(e.body())))
            await send(_body(_sse("[DONE]"), more=False))

    async def _send_json(self, status: int, body: dict, send, headers: dict[str, str] | None = None) -> None:
        data = _json(body).encode()
        all_headers = {**self._extra_headers(), **(headers or {})}
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in all_headers.items()]
        self.headers_sent = True
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": data})

    def _extra_headers(self) -> dict[str, str]:
        h: dict[str, str] = {}  # x-request-id: added by access_log.AccessLog
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
        # One body message per engine output (all its events); the last output's events go out with
        # the usage chunk and [DONE], in the stream's final message.
        samples, finished, held = len(p.prompts) * p.params.n, 0, self._opening()
        i, out = first
        while True:
            data = held + b"".join(map(self._event, self._chunks(i, out)))
            finished += out.finished
            held = data if finished >= samples else b""
            if data and not held:
                await send(_body(data))
            try:
                i, out = await outputs.__anext__()
            except StopAsyncIteration:
                break
            except BaseException:
                if held:  # events already made go out before any error event
                    with contextlib.suppress(OSError):
                        await send(_body(held))
                raise
        await send(_body(held + self._closing(), more=False))

    def _opening(self) -> bytes:
        """What a stream sends before its first chunk (the Responses API's writer sends events)."""
        return b""

    def _closing(self) -> bytes:
        """What a stream sends after its last chunk: the usage chunk if asked for, then [DONE]."""
        tail = _sse(self._chunk_base() | {"choices": [], "usage": self._usage()}) if self.p.include_usage else b""
        return tail + _sse("[DONE]")

    # -- turning engine outputs into OpenAI shapes

    def _absorb(self, i: int, out) -> tuple[int, _Choice, dict | None]:
        """Record one increment; returns (choice index, state, this increment's logprobs)."""
        p, tok = self.p, self.gw.backend.tokenizer
        if out.prompt_logprobs is not None:
            self.prompt_lps[i] = out.prompt_logprobs
        if p.score_only:  # max_tokens 0: the token computed is not part of the answer
            out = dataclasses.replace(out, new_token_ids=[], text="", logprobs=None, num_generated_tokens=0,
                                      finish_reason=out.finish_reason and "length")
        index = i * p.params.n + out.index
        c = self.choices.get(index)
        if c is None:  # with echo and logprobs, generated offsets follow the prompt's text
            c = self.choices[index] = _Choice(length=len(p.echo[i]) if p.echo and p.logprobs else 0)
        now = time.monotonic()
        if out.new_token_ids:
            if self.last_token_at is None:
                self.access["ttft_s"] = now - p.arrival
                self.gw.metrics.ttft.labels(p.model).observe(now - p.arrival)
            else:
                self._itl.observe(now - self.last_token_at)
            self.last_token_at = now
        self._generated += out.num_generated_tokens - c.generated
        c.generated = out.num_generated_tokens
        if out.num_cached_tokens:
            self.cached[i] = max(self.cached.get(i, 0), out.num_cached_tokens)
        if p.admission is not None:  # reported with lease renewals: what a dead gateway's lease settles at
            p.admission.used = self._prompt_tokens + self._generated
        c.finish_reason = out.finish_reason or c.finish_reason
        if out.finish_reason:
            c.stop_reason = out.stop_reason
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

    def _event(self, choice: dict) -> bytes:
        """`_sse` of a streamed chunk, {**_chunk_base(), "choices": [choice], ("usage": None)}: its
        constant JSON around the choice is rendered once per request."""
        if self._event_ends is None:
            head = _json(self._chunk_base())[:-1] + ',"choices":'
            self._event_ends = ("data: " + head, (',"usage":null}' if self.p.include_usage else "}") + "\n\n")
        head, tail = self._event_ends
        if self.p.continuous_usage:  # vLLM's continuous_usage_stats: the usage so far on every chunk
            tail = f',"usage":{_json(self._usage())}}}\n\n'
        return f"{head}[{_flat_json(choice)}]{tail}".encode()

    def _chunks(self, i: int, out) -> list[dict]:
        """The choice of each chunk this increment streams (one choice per chunk)."""
        p = self.p
        first_of_choice = (i * p.params.n + out.index) not in self.choices
        index, _, delta_lp = self._absorb(i, out)
        if p.kind == "completion":
            generated = "" if p.score_only else out.text
            text = p.echo[i] + generated if p.echo and first_of_choice else generated
            if p.echo and p.logprobs and first_of_choice:
                delta_lp = self._echo_logprobs(i, delta_lp)
            if p.score_only:
                finish = out.finish_reason and "length"
                choice = {"index": index, "text": text, "logprobs": delta_lp, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text, "logprobs": delta_lp, "finish_reason": out.finish_reason}
            if choice["finish_reason"]:
                choice["stop_reason"] = out.stop_reason
            if p.prompt_logprobs and first_of_choice:
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(i)
            return [choice]
        chunks = []
        if first_of_choice:
            chunks.append({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None})
        text = out.text
        if p.reasoning is not None:  # thinking apart from the answer: gateway/reasoning.py
            thought, text = p.reasoning.feed(index, text, out.finish_reason is not None)
            if thought:
                chunks.append({"index": index, "delta": {"reasoning_content": thought}, "logprobs": delta_lp,
                               "finish_reason": None})
                delta_lp = None  # this increment's logprobs went with its first chunk
        if p.tools is not None:  # text that may be tool calls: gateway/structured/tools.py
            deltas, reason = p.tools.stream(index, text, out.finish_reason)
            if reason:
                self.choices[index].finish_reason = reason
            for k, delta in enumerate(deltas or ([{}] if delta_lp or reason else [])):
                last = k == max(len(deltas), 1) - 1
                chunks.append({"index": index, "delta": delta, "logprobs": delta_lp if k == 0 else None,
                               "finish_reason": reason if last else None}
                              | ({"stop_reason": out.stop_reason} if reason and last else {}))
        elif text or delta_lp or out.finish_reason:
            delta = {"content": text} if text else {}
            chunks.append({"index": index, "delta": delta, "logprobs": delta_lp, "finish_reason": out.finish_reason}
                          | ({"stop_reason": out.stop_reason} if out.finish_reason else {}))
        return chunks

    def _token_text(self, token_id: int) -> str:
        return _token_text(self.gw.backend.tokenizer, token_id)

    def _echo_logprobs(self, i: int, generated: dict | None) -> dict:
        """The prompt's logprobs lists (echo with logprobs), followed by those of generated tokens."""
        lps = self.prompt_lps.get(i) or [None] * len(self.p.prompts[i])
        out = echo_lists(self._token_text, self.p.prompts[i], lps, self.p.params.logprobs or 0)
        for key, values in (generated or {}).items():
            out[key] += values
        return out

    def _vllm_prompt_logprobs(self, i: int) -> list | None:
        lps = self.prompt_lps.get(i)
        return None if lps is None else vllm_lists(self._token_text, lps)

    def _usage(self) -> dict:
        prompt = self._prompt_tokens
        completion = sum(c.generated for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}

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
                    offsets, pos = [], len(p.echo[index // p.params.n]) if p.echo else 0
                    for t in c.tokens:
                        offsets.append(pos)
                        pos += len(t)
                    lp = {"tokens": c.tokens, "token_logprobs": c.token_logprobs, "top_logprobs": c.top,
                          "text_offset": offsets}
                    if p.echo:
                        lp = self._echo_logprobs(index // p.params.n, lp)
                choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
            else:
                thought = None
                if p.reasoning is not None:
                    thought, text = p.reasoning.split(text)
                message, reason = ({"role": "assistant", "content": text}, c.finish_reason) if p.tools is None \
                    else p.tools.final(text or "", c.finish_reason)
                if thought is not None:  # an answer left empty after the thinking is null, as in vLLM
                    message |= {"reasoning_content": thought, "content": message.get("content") or None}
                choices.append({"index": index, "message": message,
                                "logprobs": {"content": c.chat_logprobs} if p.logprobs else None,
                                "finish_reason": reason, "stop_reason": c.stop_reason})
        if p.prompt_logprobs:
            for choice in choices:
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(choice["index"] // p.params.n)
        obj = "text_completion" if p.kind == "completion" else "chat.completion"
        return {"id": p.request_id, "object": obj, "created": p.created, "model": p.model,
                "choices": choices, "usage": self._usage()}


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


