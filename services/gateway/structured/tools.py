"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`.

- Tools reach the model through its chat template (jinja2 gets `tools`, and assistant `tool_calls`
  with their arguments as objects, as transformers passes them). A template that never reads
  `tools` gets them in a default system message instead (`default_tools_message`, documented in
  docs/tool_calling.md), and earlier calls written into the assistant turns in the parser's format.
- `tool_choice: "required"` and a named function are enforced with structured output: the output
  must be a JSON list of `{"name", "arguments"}` calls (one call unless `parallel_tool_calls`), or
  the named function's arguments object, so even a small model returns calls that parse and match
  the parameters' schemas. `auto` needs `--enable-auto-tool-choice`: the `--tool-call-parser`
  reads calls out of free text. `none` leaves the output as text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import jinja2.meta
from kvrelay.engine.structured.spec import GuidedSpec
from kvrelay.gateway import errors
from kvrelay.gateway.structured.tool_parsers import ParsedCall, get_parser
from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128
_NAME = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDef(_Strict):
    name: _NAME
    description: Annotated[str, Field(max_length=8192)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: str


class ToolCall(_Strict):
    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"]
    function: ToolCallFunction


class ToolFields(_Strict):
    """Mixed into the chat request body."""

    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


@dataclass(frozen=True)
class ToolSettings:
    parser: str | None = None  # --tool-call-parser
    enable_auto: bool = False  # --enable-auto-tool-choice


def template_reads_tools(tokenizer) -> bool:
    source = getattr(tokenizer, "chat_template_source", "")
    env = jinja2.Environment()
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateError:
        return False


def default_tools_message(tools: list[ToolDef], parser_name: str | None) -> str:
    """The system text that gives tools to a model whose chat template ignores them."""
    example = get_parser(parser_name).render([("NAME", {"ARG": "VALUE"})])
    listed = "\n".join(json.dumps({"name": t.function.name} | (
        {"description": t.function.description} if t.function.description else {}) | {
        "parameters": t.function.parameters or {"type": "object"}}, separators=(",", ":")) for t in tools)
    return f"Tools:\n{listed}\nTo call tools, answer only with:\n{example}"


def _schema_of(t: ToolDef) -> dict:
    return t.function.parameters or {"type": "object"}


def _calls_schema(tools: list[ToolDef], parallel: bool) -> dict:
    one = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _schema_of(t)},
            "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": one} if len(one) > 1 else one[0]}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass
class _ChoiceState:
    text: str = ""
    mode: str = "text"  # auto: "call" once the parser's marker appeared; named: "args" once opened
    pending: str = ""  # auto: text held back because it may begin the marker
    call_text: str = ""  # auto: from the marker on, held until the choice ends


@dataclass
class ToolPlan:
    """How one request's output becomes tool calls."""

    choice: str  # "auto" | "required" | "named" | "none"
    settings: ToolSettings
    function: str | None = None  # the named function
    states: dict[int, _ChoiceState] = field(default_factory=dict)

    # ---- the request side

    def constraint(self, tools: list[ToolDef], parallel: bool) -> GuidedSpec | None:
        if self.choice == "required":
            return GuidedSpec("json", json.dumps(_calls_schema(tools, parallel)), "tool_choice")
        if self.choice == "named":
            tool = next(t for t in tools if t.function.name == self.function)
            return GuidedSpec("json", json.dumps(_schema_of(tool)), "tool_choice")
        return None

    # ---- the response side

    def parse(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ParsedCall]]:
        if finish_reason not in ("stop", None):  # cut off: never reported as (valid) calls
            return text, []
        if self.choice == "named":
            return None, [ParsedCall(self.function, text)]
        if self.choice == "required":
            try:
                calls = [ParsedCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                         for c in json.loads(text)]
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []
            return None, calls
        if self.choice == "auto":
            return get_parser(self.settings.parser).parse(text)
        return text, []

    @staticmethod
    def _call_json(call: ParsedCall) -> dict:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def final(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message and finish reason of a finished choice."""
        content, calls = self.parse(text, finish_reason)
        message: dict = {"role": "assistant", "content": content}
        if not calls:
            return message | {"content": text}, finish_reason
        message["tool_calls"] = [self._call_json(c) for c in calls]
        # OpenAI ends a forced named call with "stop", calls the model chose with "tool_calls".
        return message, ("stop" if self.choice == "named" else "tool_calls")

    def stream(self, index: int, piece: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """Deltas to send for a new piece of text of choice `index`, and the finish reason to report."""
        s = self.states.setdefault(index, _ChoiceState())
        s.text += piece
        if self.choice == "none":
            return ([{"content": piece}] if piece else []), finish_reason
        if self.choice == "named":  # cut by length, its streamed arguments stay unfinished (finish "length")
            deltas = []
            if s.mode != "args":  # the call opens at once; its arguments stream as they are generated
                s.mode = "args"
                call = self._call_json(ParsedCall(self.function, ""))
                deltas.append({"tool_calls": [{"index": 0, **call}]})
            if piece:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            return deltas, finish_reason
        if self.choice == "auto":
            return self._stream_auto(s, piece, finish_reason)
        if finish_reason is None:
            return [], None  # required: the list of calls is sent when the choice ends
        message, reason = self.final(s.text, finish_reason)
        deltas = [{"content": message["content"]}] if message.get("content") else []
        return deltas + _call_deltas(message.get("tool_calls", [])), reason

    def _stream_auto(self, s: _ChoiceState, piece: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """Text streams as content except from the parser's marker on (and a tail that may begin
        it): that is held until the choice ends, then sent as calls if it parses, else as text."""
        parser = get_parser(self.settings.parser)
        deltas = []
        if s.mode == "call":
            s.call_text += piece
        else:
            s.pending += piece
            cut = s.pending.find(parser.marker)
            if cut >= 0:
                out, s.call_text, s.pending, s.mode = s.pending[:cut], s.pending[cut:], "", "call"
            else:
                keep = next((n for n in range(min(len(parser.marker) - 1, len(s.pending)), 0, -1)
                             if parser.marker.startswith(s.pending[-n:])), 0)
                out, s.pending = s.pending[: len(s.pending) - keep], s.pending[len(s.pending) - keep :]
            if out:
                deltas.append({"content": out})
        if finish_reason is None:
            return deltas, None
        if s.mode == "call" and finish_reason == "stop":
            _, calls = parser.parse(s.call_text)
            if calls:
                return deltas + _call_deltas([self._call_json(c) for c in calls]), "tool_calls"
        rest = s.pending + s.call_text
        return deltas + ([{"content": rest}] if rest else []), finish_reason


def _call_deltas(calls: list[dict]) -> list[dict]:
    """OpenAI's streamed shape of finished calls: per call its id and name, then its arguments."""
    deltas = []
    for i, call in enumerate(calls):
        deltas.append({"tool_calls": [{"index": i, **call, "function": {"name": call["function"]["name"],
                                                                          "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]})
    return deltas


def plan(body, settings: ToolSettings, tokenizer, messages: list[dict]) -> tuple[ToolPlan | None, list[dict],
                                                                                  dict]:
    """Check the tool fields; returns (plan, messages for the template, extra template variables)."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is not None and not tools and choice != "none":
        raise errors.bad_request("tool_choice: needs `tools`", "tool_choice")
    if not tools:
        return None, _history(body, messages, None, False), {}
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise errors.bad_request("tools: function names must be unique", "tools")
    if choice is None:
        choice = "auto" if settings.enable_auto else "none"
    function = None
    if isinstance(choice, NamedToolChoice):
        function = choice.function.name
        if function not in names:
            raise errors.bad_request(f"tool_choice: no tool named {function!r}; tools: {names}", "tool_choice")
        choice = "named"
    if choice == "auto" and not (settings.enable_auto and settings.parser):
        raise errors.bad_request('tool_choice: "auto" needs the server started with --enable-auto-tool-choice '
                                 "and --tool-call-parser", "tool_choice")
    if choice in ("required", "named") and _constrained(body):
        raise errors.bad_request(f"tool_choice: {choice!r} cannot be combined with another output constraint",
                                 "tool_choice")
    native = template_reads_tools(tokenizer)
    messages = _history(body, messages, settings.parser, native)
    kwargs = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if native else {}
    if not native:
        text = default_tools_message(tools, settings.parser)
        if messages and messages[0]["role"] == "system":
            messages[0] = messages[0] | {"content": text + "\n\n" + messages[0]["content"]}
        else:
            messages.insert(0, {"role": "system", "content": text})
    return ToolPlan(choice, settings, function), messages, kwargs


def _constrained(body) -> bool:
    rf = body.response_format
    return (rf is not None and rf.type != "text") or any(
        getattr(body, f) is not None for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                               "structured_outputs"))


def _history(body, messages: list[dict], parser: str | None, native: bool) -> list[dict]:
    """Assistant tool calls and tool results of earlier turns, as the template reads them."""
    out = []
    for m, rendered in zip(body.messages, messages):
        rendered = dict(rendered)
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except json.JSONDecodeError as e:
                    raise errors.bad_request(f"messages: tool call {c.id!r} has arguments that are not JSON: {e}",
                                             "messages") from e
                calls.append((c, args))
            if native:
                rendered["tool_calls"] = [{"id": c.id, "type": "function",
                                           "function": {"name": c.function.name, "arguments": a}} for c, a in calls]
            else:
                written = get_parser(parser).render([(c.function.name, a) for c, a in calls])
                rendered["content"] = (rendered.get("content") or "") + written
        if m.tool_call_id is not None:
            rendered["tool_call_id"] = m.tool_call_id
        out.append(rendered)
    return out
