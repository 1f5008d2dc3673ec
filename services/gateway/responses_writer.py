"""The Responses API's answer (`responses_api.py`) from a chat generation: a Response object, or its
stream of typed events.

The chat path makes the choice (text, reasoning, tool calls); this writer turns it into output
items: `reasoning` (with --reasoning-parser), `message` with one `output_text` part, and one
`function_call` item per call. Streamed, each chat delta becomes the events that open an item, add
to it and close it (`response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ... `response.output_item.done`), between
`response.created` / `response.in_progress` and `response.completed` (its status "incomplete" when
max_output_tokens cut it), whose Response object holds the items as streamed, ids included.
"""

from __future__ import annotations

import uuid

from kvrelay.gateway.errors import ApiError
from kvrelay.gateway.response import GenerationResponse, _body, _json


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesResponse(GenerationResponse):
    def __init__(self, gateway, prepared, request: dict):
        super().__init__(gateway, prepared)
        self.request = request  # the request's parameters, echoed in the Response object
        self.response_id = _id("resp")
        self.items: list[dict] = []  # output items streamed so far; the last may be open
        self.open = False  # whether the last item still takes deltas
        self.sequence = 0

    # -- the Response object

    def _object(self, status: str, output: list[dict], usage: dict | None) -> dict:
        r = self.request
        if status == "incomplete" and output:  # the item max_output_tokens cut
            output[-1]["status"] = "incomplete"
        tools = [{"type": "function", **t, "strict": t.get("strict")} for t in r.get("tools") or []]
        return {
            "id": self.response_id, "object": "response", "created_at": self.p.created, "status": status,
            "model": self.p.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.get("instructions"), "max_output_tokens": r.get("max_output_tokens"),
            "parallel_tool_calls": r.get("parallel_tool_calls") is not False,
            "previous_response_id": None, "reasoning": r.get("reasoning") or {"effort": None, "summary": None},
            "store": False, "temperature": r.get("temperature"), "top_p": r.get("top_p"),
            "text": r.get("text") or {"format": {"type": "text"}}, "tool_choice": r.get("tool_choice") or "auto",
            "tools": tools, "truncation": "disabled", "metadata": r.get("metadata") or {}, "user": r.get("user"),
            "usage": usage,
        }

    def _usage_object(self) -> dict:
        u = self._usage()
        return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
                "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"]}

    def _status(self) -> str:
        reason = next(iter(self.choices.values())).finish_reason if self.choices else None
        return "incomplete" if reason == "length" else "completed"

    def _final_body(self) -> dict:
        message = super()._final_body()["choices"][0]["message"]
        output = []
        if message.get("reasoning_content") is not None:
            output.append(_reasoning(_id("rs"), message["reasoning_content"], "completed"))
        if message.get("content"):
            output.append(_message(_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls") or []:
            output.append(_call(_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"],
                                "completed"))
        return self._object(self._status(), output, self._usage_object())

    # -- the stream of events

    def _send(self, kind: str, **fields) -> bytes:
        data = _json({"type": kind, "sequence_number": self.sequence, **fields})  # the items as they are now
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def _opening(self) -> bytes:
        start = self._object("in_progress", [], None)
        return self._send("response.created", response=start) + self._send("response.in_progress", response=start)

    def _event(self, choice: dict) -> bytes:
        """The events of one chat chunk's choice (its delta)."""
        delta, out = choice.get("delta") or {}, b""
        if delta.get("reasoning_content"):
            out += self._ensure_open("reasoning") + self._add(delta["reasoning_content"])
        if delta.get("content"):
            out += self._ensure_open("message") + self._add(delta["content"])
        for call in delta.get("tool_calls") or []:
            if call.get("id"):  # a new call
                out += self._close()
                item = _call(_id("fc"), call["id"], call["function"]["name"], "", "in_progress")
                out += self._open_item(item)
            arguments = (call.get("function") or {}).get("arguments")
            if arguments:
                out += self._add(arguments)
        return out

    def _ensure_open(self, kind: str) -> bytes:
        if self.open and self.items[-1]["type"] == kind:
            return b""
        out = self._close()
        item = _reasoning(_id("rs"), "", "in_progress") if kind == "reasoning" else \
            _message(_id("msg"), "", "in_progress")
        out += self._open_item(item)
        if kind == "message":
            out += self._send("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        return out

    def _open_item(self, item: dict) -> bytes:
        self.items.append(item)
        self.open = True
        return self._send("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def _add(self, text: str) -> bytes:
        item, index = self.items[-1], len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            item["arguments"] += text
            return self._send("response.function_call_arguments.delta", **where, delta=text)
        item["content"][0]["text"] += text
        kind = "response.output_text.delta" if item["type"] == "message" else "response.reasoning_text.delta"
        return self._send(kind, **where, content_index=0, delta=text,
                          **({"logprobs": []} if item["type"] == "message" else {}))

    def _close(self) -> bytes:
        if not self.open:
            return b""
        self.open = False
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            out = self._send("response.function_call_arguments.done", **where, arguments=item["arguments"])
        else:
            part = item["content"][0]
            kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            out = self._send(kind, **where, content_index=0, text=part["text"])
            if item["type"] == "message":
                out += self._send("response.content_part.done", **where, content_index=0, part=part)
        return out + self._send("response.output_item.done", output_index=index, item=item)

    def _closing(self) -> bytes:
        # response.completed even when max_output_tokens cut it (its status says "incomplete"), as vLLM
        # sends it: client libraries take the final Response from that event.
        out = self._close()
        return out + self._send("response.completed", response=self._object(self._status(), self.items,
                                                                              self._usage_object()))

    async def _fail(self, e: ApiError, send) -> None:
        if not self.headers_sent:
            return await super()._fail(e, send)
        self.gw.metrics.errors.labels(str(e.status)).inc()
        error = e.body()["error"]
        failed = self._object("failed", self.items, self._usage_object()) | {
            "error": {"code": error.get("code") or "server_error", "message": error["message"]}}
        await send(_body(self._send("error", code=error.get("code"), message=error["message"],
                                    param=error.get("param")) + self._send("response.failed", response=failed),
                         more=False))


def _message(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
