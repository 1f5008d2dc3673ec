"""The bytes of streamed answers: each event is exactly json.dumps(chunk, ensure_ascii=False,
separators=(",", ":")) with the chunk's keys in OpenAI's order, and the events of one engine output
(and the last output's with the usage chunk and [DONE]) share one ASGI body message, every event in
order. The ASGI app is called directly (no server), on the real engine in this process."""

from __future__ import annotations

import asyncio
import json

import pytest
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.gateway.app import Gateway, create_app
from kvrelay.gateway.backend import LocalBackend
from kvrelay.gateway.gateway import GatewayConfig
from kvrelay.gateway.response import _flat_json
from kvrelay.gateway.structured import tools as tool_calling

MODEL = "stories260K"
PROMPT = "Héllo wörld ✓ Once upon a time"  # not ASCII: the events keep it as UTF-8, unescaped
MESSAGES = [{"role": "user", "content": PROMPT}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}]
BASE = {"model": MODEL, "max_tokens": 6, "temperature": 0.0}
USAGE = {"stream_options": {"include_usage": True}}
CASES = [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/completions", {"prompt": PROMPT, **USAGE}),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 2}),
    ("/v1/completions", {"prompt": PROMPT, "n": 2, "temperature": 1.0, "seed": 3, **USAGE}),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1}),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 0, **USAGE}),
    ("/v1/completions", {"prompt": [PROMPT, "The end"], "prompt_logprobs": 1}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/chat/completions", {"messages": MESSAGES, **USAGE}),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2, "temperature": 1.0, "seed": 3}),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 40,
                              **USAGE}),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"}),
]

IDS = [f"{path.removeprefix('/v1/').replace('/', '-')}-{'-'.join(extra)}" for path, extra in CASES]


async def _post(app, path: str, body: dict) -> list[dict]:
    """One request through the ASGI app; the messages it sent."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
    sent, delivered, never = [], False, asyncio.Event()

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await never.wait()

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent


@pytest.fixture(scope="module")
def answers():
    """(case, streamed body messages, non-streamed answer) for every case, from one gateway."""

    async def run():
        config = GatewayConfig(tools=tool_calling.ToolSettings("hermes", True))
        gateway = Gateway(LocalBackend(EngineArgs()), config=config)
        app = create_app(gateway)
        await gateway.start()
        try:
            out = []
            for path, extra in CASES:
                body = {**BASE, **extra}
                streamed = await _post(app, path, {**body, "stream": True})
                plain = await _post(app, path, {k: v for k, v in body.items() if k != "stream_options"})
                out.append(((path, extra), streamed, json.loads(plain[-1]["body"])))
            return out
        finally:
            await gateway.shutdown()

    return asyncio.run(run())


def _events(messages: list[dict]) -> list[list[str]]:
    """Each body message's SSE events (their data), checking the framing."""
    out = []
    for m in messages[1:]:
        assert m["type"] == "http.response.body"
        text = m["body"].decode()
        assert text.startswith("data: ") and text.endswith("\n\n"), text
        out.append([e.removeprefix("data: ") for e in text[:-2].split("\n\ndata: ")] if text else [])
    return out


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_every_event_is_the_canonical_json_of_its_chunk(answers, index):
    (_path, extra), streamed, plain = answers[index]
    assert streamed[0]["status"] == 200, streamed
    events = [e for batch in _events(streamed) for e in batch]
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    keys = ["id", "object", "created", "model", "choices"] + (["usage"] if "stream_options" in extra else [])
    for data in events[:-1]:
        chunk = json.loads(data)
        assert data == json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
        assert list(chunk) == keys
        assert chunk["id"].startswith(plain["id"].split("-")[0] + "-") and chunk["model"] == MODEL
    if "echo" in extra:
        assert PROMPT in "".join(events)  # raw UTF-8, not \u escapes


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_batched_events_carry_the_whole_answer_in_order(answers, index):
    (path, extra), streamed, plain = answers[index]
    batches = _events(streamed)
    assert all(m["more_body"] for m in streamed[1:-1]) and not streamed[-1]["more_body"]
    assert all(batches[:-1]), "no empty body messages"
    last = batches[-1]
    assert last[-1] == "[DONE]" and len(last) >= 2, "the last output's events go out with [DONE]"
    chunks = [json.loads(e) for batch in batches for e in batch[:-1 if batch is last else None]]
    if "stream_options" in extra:
        usage = chunks[-1]["usage"]  # the second run of a prompt finds it in the prefix cache: not compared
        assert chunks[-1]["choices"] == [] and usage.pop("prompt_tokens_details") is not None
        assert usage == {k: plain["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        assert all(c["usage"] is None for c in chunks[:-1])
    if "tools" in extra:
        return  # tool-call deltas have their own reassembly tests (test_tool_calling.py)
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c["choices"]:
            part = choice.get("text") if path == "/v1/completions" else choice["delta"].get("content")
            texts[choice["index"]] = texts.get(choice["index"], "") + (part or "")
    want = {c["index"]: c["text"] if path == "/v1/completions" else c["message"]["content"] for c in plain["choices"]}
    assert texts == want


@pytest.mark.parametrize("obj", [
    {"index": 0, "text": "plain", "logprobs": None, "finish_reason": None},
    {"index": 12, "text": 'q"uote\\ \n\t\x00\x1f \u2028 é ✓ 😀 \ud800', "finish_reason": "stop"},
    {"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
    {"index": 1, "delta": {}, "logprobs": {"content": [{"token": "a", "logprob": -0.5, "bytes": [97]}]}},
    {"index": -3, "big": 2**70, "flag": True, "off": False, "x": 1.5, "nan": float("nan"), "e": 1e300},
    {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\": 1}"}}]}},
    {1: "int key", "s": "x"}, {"k": {2: None}}, {}, {"d": {"e": {}}},
])
def test_flat_json_is_json_dumps(obj):
    assert _flat_json(obj) == json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
