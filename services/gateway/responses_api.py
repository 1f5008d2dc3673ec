"""POST /v1/responses: OpenAI's Responses API, stateless, over the chat path.

A request becomes a chat request: `instructions` a system message, `input` items the conversation
(messages, `function_call` items the assistant's tool calls, `function_call_output` items tool
messages, `reasoning` items the next assistant turn's `reasoning_content`), function `tools` and
`tool_choice` the chat ones, `text.format` the `response_format`, `reasoning.effort` the template's
`reasoning_effort`, `max_output_tokens` `max_completion_tokens`. It is then prepared, admitted and
generated as a chat request (quotas, fairness, tools, grammars, the reasoning parser), and
`responses_writer.py` writes the answer as a Response object or its stream of events.

Nothing is stored: `previous_response_id` is refused (send the whole conversation in `input`), and
`store` is accepted and reported false. Only function tools exist here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from kvrelay.gateway import errors
from kvrelay.gateway.deps import gateway_of, tenant_of
from kvrelay.gateway.responses_writer import ResponsesResponse
from kvrelay.gateway.schemas import GENERATION_RESPONSES, ChatCompletionRequest, Int, _Strict
from kvrelay.gateway.tenants import Tenant
from pydantic import Field, ValidationError

router = APIRouter()
MAX_INPUT_ITEMS = 2048
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(_Strict):
    model: str
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    max_output_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None


def _text(content, where: str) -> str:
    """A message's content: a string, or text parts (input_text / output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise errors.bad_request(f"{where}: must be a string or a list of content parts", where)
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise errors.bad_request(f"{where}[{k}]: parts of type {kind!r} are not supported: this server's "
                                     f"models take text only ({', '.join(TEXT_PARTS[:2])})", f"{where}[{k}]")
        out.append(part["text"])
    return "".join(out)


def _has_images(content) -> bool:
    return isinstance(content, list) and all(isinstance(p, dict) for p in content) and any(
        p.get("type") == "input_image" for p in content)


def _parts(content: list, where: str) -> list[dict]:
    """A user message with images as chat content parts: input_image's image_url (a data: or http(s)
    URL) becomes an image_url part, which a vision-language model reads (gateway/images.py)."""
    out = []
    for k, part in enumerate(content):
        if part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise errors.bad_request(f"{where}[{k}].image_url: a data: or http(s) URL is needed (file_id is not "
                                         "supported)", f"{where}[{k}].image_url")
            out.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        else:
            raise errors.bad_request(f"{where}[{k}]: parts of type {part.get('type')!r} are not supported here "
                                     f"({', '.join(TEXT_PARTS[:2])}, input_image)", f"{where}[{k}]")
    return out


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise errors.bad_request(f"{where}.{name}: must be a string", f"{where}.{name}")
    return value


def messages_of(body: ResponsesRequest, images: bool = False) -> list[dict]:
    """The chat messages of instructions and input; images: the model reads input_image parts."""
    messages: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    thinking = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise errors.bad_request(f"{where}.role: must be user, assistant, system or developer",
                                         f"{where}.role")
            content = item.get("content")
            if images and role == "user" and _has_images(content):
                messages.append({"role": role, "content": _parts(content, f"{where}.content")})
            else:
                messages.append({"role": role, "content": _text(content, f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function", "function": {
                "name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the turn's text, or its earlier calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                             "content": _text(output, f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thinking = "".join(p.get("text", "") for p in parts if isinstance(p, dict)) or None
            continue
        else:
            raise errors.bad_request(f"{where}.type: {kind!r} items are not supported here (message, "
                                     "function_call, function_call_output, reasoning)", f"{where}.type")
        if thinking and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"], thinking = thinking, None
    return messages


def _tools(body: ResponsesRequest) -> dict:
    out: dict = {}
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            if t.get("type") != "function":
                raise errors.bad_request(f"tools[{i}].type: only function tools exist here, not {t.get('type')!r}",
                                         f"tools[{i}].type")
            tools.append({"type": "function", "function": {k: t[k] for k in (
                "name", "description", "parameters", "strict") if k in t}})
        out["tools"] = tools
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise errors.bad_request("tool_choice: none, auto, required or {\"type\": \"function\", \"name\": ...}",
                                     "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    if body.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = body.parallel_tool_calls
    return out


def _response_format(text: dict | None) -> dict:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return {}
    if fmt.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise errors.bad_request("text.format.type: one of text, json_object, json_schema", "text.format.type")


def to_chat(body: ResponsesRequest, images: bool = False) -> ChatCompletionRequest:
    if body.previous_response_id is not None:
        raise errors.bad_request("previous_response_id: this server keeps no responses: send the whole "
                                 "conversation in `input`", "previous_response_id")
    chat = {"model": body.model, "messages": messages_of(body, images), "stream": body.stream, **_tools(body),
            **_response_format(body.text)}
    for name, value in (("max_completion_tokens", body.max_output_tokens), ("temperature", body.temperature),
                        ("top_p", body.top_p), ("user", body.user), ("metadata", body.metadata),
                        ("reasoning_effort", (body.reasoning or {}).get("effort"))):
        if value is not None:
            chat[name] = value
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:  # named by the chat field it maps to
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise errors.bad_request(f"{where}: {first.get('msg', 'invalid value')} (as the chat request this "
                                 "maps to)", where or None) from e


@router.post("/v1/responses", responses=GENERATION_RESPONSES)
async def responses(body: ResponsesRequest, request: Request, tenant: Annotated[Tenant, Depends(tenant_of)]):
    gateway = gateway_of(request)
    prepared = await gateway.prepare_chat(to_chat(body, getattr(gateway.backend, "images", None) is not None), tenant)
    await gateway.admit(prepared)
    return ResponsesResponse(gateway, prepared, body.model_dump(exclude={"input", "stream", "include"}))
