"""Turn a model's text into OpenAI tool calls, per model family (`--tool-call-parser`).

- `hermes` (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per call;
- `llama3_json` (Llama 3.1-3.3): `{"name": ..., "parameters": {...}}`, calls separated by `;`,
  optionally after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`;
- `pythonic` (Llama 3.2 and 4 with their pythonic templates, and others prompted so): the whole
  answer is a Python list of calls with keyword arguments, `[get_weather(city="Paris"), now()]`,
  optionally inside `<|python_start|>...<|python_end|>`. It is read with `ast` (never run): each
  argument must be a literal.

Each parser also says how a call is written (`render`), which the default tools system message and
earlier assistant turns use when the chat template has no tool support, and which text prefix
means "a call may be starting" (`marker`), so a stream holds text back only while it may be one.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


def _call_of(obj, args_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separators: str) -> list | None:
    """Consecutive JSON values in text, separated by characters of separators; None unless all of it parses."""
    values, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        values.append(value)


class ToolParser:
    name = ""
    marker = ""

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls); no calls when the text is not a well-formed call."""
        raise NotImplementedError

    def render(self, calls: list[tuple[str, dict]]) -> str:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        bodies = self._call.findall(text[start:])
        if len(bodies) != text.count(self.marker):  # a call left open (cut off): text, not calls
            return text, []
        calls = []
        for body in bodies:
            values = _json_values(body, "")
            call = _call_of(values[0], "arguments") if values and len(values) == 1 else None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start].strip() or None
        return (content, calls) if calls else (text, [])

    def render(self, calls):
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    marker = "{"

    def parse(self, text):
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        values = _json_values(body, ";")
        calls = [_call_of(v, "parameters") for v in values or []]
        if not calls or None in calls:
            return text, []
        return None, calls

    def render(self, calls):
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


class MistralParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def parse(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        values = _json_values(text[start + len(self.marker):], "")
        items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else None
        calls = [_call_of(v, "arguments") for v in items or []]
        if not calls or None in calls:
            return text, []
        return text[:start].strip() or None, calls

    def render(self, calls):
        return self.marker + json.dumps([{"name": n, "arguments": a} for n, a in calls])


class PythonicParser(ToolParser):
    name = "pythonic"
    marker = "["
    MAX_CHARS = 64 * 1024  # a longer answer is text: ast's recursion grows with nesting

    def parse(self, text):
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        if not (body.startswith("[") and body.endswith("]")) or len(body) > self.MAX_CHARS:
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            calls = [self._call(node) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return text, []
        return (None, calls) if None not in calls else (text, [])

    @staticmethod
    def _call(node) -> ParsedCall | None:
        """name(key=literal, ...) as a call; anything else (positional arguments, a dotted or computed
        name, a non-literal value) is not one."""
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if any(k.arg is None for k in node.keywords):  # **kwargs
            return None
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False))

    def render(self, calls):
        return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                             PythonicParser)}


def get_parser(name: str | None) -> ToolParser:
    """The named parser (hermes when none is configured: only used to render tools then)."""
    return PARSERS[name or "hermes"]()
