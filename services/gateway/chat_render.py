"""Rendering chat messages into prompt ids, with vLLM's chat-template fields.

- `chat_template_kwargs`: extra variables for the model's chat template, such as Qwen3's
  `enable_thinking`. They cannot replace the variables the server sets itself.
- `add_generation_prompt` (default true): end the prompt with the opening of the assistant's turn.
- `continue_final_message`: end the prompt inside the final message, an assistant turn, so the
  model continues it ("prefill" the answer). It needs `add_generation_prompt: false`, as in vLLM.
  The template renders the whole chat, and the text is cut after the final message's content, as
  transformers' `apply_chat_template(continue_final_message=True)` does.

/v1/chat/completions and /tokenize render through `render`, so /tokenize counts exactly the ids a
chat request runs on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from kvrelay.engine.errors import InvalidRequestError
from kvrelay.gateway import errors
from pydantic import BaseModel, ConfigDict

# Set by the server (Tokenizer.apply_chat_template and tool calling): a request may not override them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class ChatTemplateFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI's field: given to the template as the variable `reasoning_effort` (as vLLM does; gpt-oss's
    # template reads it), which templates that do not read it ignore.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


def message_texts(messages) -> list[str]:
    """The text of the request's messages (schemas.ChatMessage): contents and text parts."""
    return [t for m in messages
            for t in ([m.content] if isinstance(m.content, str) else [p.text for p in m.content or [] if p.type == "text"])]


def image_parts(messages) -> list[tuple[str, str]]:
    """(field, url) of each image part of the request's messages, in order."""
    return [(f"messages[{i}].content[{j}].image_url.url", p.image_url.url) for i, m in enumerate(messages)
            if isinstance(m.content, list) for j, p in enumerate(m.content) if p.type == "image_url"]


def template_messages(messages, images: bool = False) -> list[dict]:
    """The request's messages (schemas.ChatMessage) as the chat template reads them. Content is a
    string, except a user message with images (images: the model reads them) is a list of parts as
    vision-language templates read it: {"type": "text", "text"} and {"type": "image"}."""
    out = []
    for i, m in enumerate(messages):
        parts = [] if isinstance(m.content, str) else m.content or []
        pictures = [j for j, p in enumerate(parts) if p.type == "image_url"]
        if pictures:
            field = f"messages[{i}].content[{pictures[0]}]"
            if not images:
                raise errors.bad_request(f"{field}: this model takes text only: it cannot read images", field)
            if m.role != "user":
                raise errors.bad_request(f"{field}: images go in user messages, not in {m.role} messages", field)
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in parts if p.type == "text")
        errors.check_text(content, f"messages[{i}].content")
        if pictures:
            content = [{"type": "image"} if p.type == "image_url" else {"type": "text", "text": p.text} for p in parts]
        for name, instead in (("function_call", "send tool_calls"), ("audio", "send text")):
            if getattr(m, name) is not None:
                raise errors.bad_request(f"messages[{i}].{name}: not supported here: {instead}",
                                         f"messages[{i}].{name}")
        out.append({"role": m.role, "content": content} | ({"name": m.name} if m.name else {})
                   | ({"reasoning_content": m.reasoning_content} if m.reasoning_content else {}))
    return out


def template_variables(body: ChatTemplateFields, server_vars: dict) -> dict:
    """The request's chat_template_kwargs joined with the server's own variables (tools)."""
    extra = body.chat_template_kwargs or {}
    if body.reasoning_effort is not None:
        if extra.get("reasoning_effort", body.reasoning_effort) != body.reasoning_effort:
            raise errors.bad_request("chat_template_kwargs: its reasoning_effort differs from the request's "
                                     "reasoning_effort: send one", "chat_template_kwargs")
        extra = extra | {"reasoning_effort": body.reasoning_effort}
    taken = sorted((RESERVED_VARIABLES | server_vars.keys()) & extra.keys())
    if taken:
        raise errors.bad_request(
            f"chat_template_kwargs: {', '.join(map(repr, taken))} cannot be set here: the server sets "
            "them (send tools in `tools`, and add_generation_prompt as a field of its own)", "chat_template_kwargs")
    return extra | server_vars


def check_continuation(body: ChatTemplateFields, messages: list[dict]) -> None:
    if not body.continue_final_message:
        return
    if body.add_generation_prompt:
        raise errors.bad_request("continue_final_message: cannot be combined with add_generation_prompt, which "
                                 "defaults to true: send `add_generation_prompt: false`", "continue_final_message")
    last = messages[-1]
    if last["role"] != "assistant" or not (last.get("content") or "").strip():
        raise errors.bad_request("continue_final_message: the last message must be an assistant message with "
                                 "the text to continue", "continue_final_message")


def load_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself when it reads as a jinja2 template (as vLLM
    takes it). Raises ValueError saying what is wrong, for the start-up checks (kvrelay.preflight)."""
    import jinja2

    path = Path(value).expanduser()
    if path.is_file():
        text = path.read_text()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template {value}: no such file, and not a jinja2 template either")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: line {e.lineno}: {e.message}") from e
    return text


def render(tok, messages: list[dict], body: ChatTemplateFields, server_vars: dict,
           allow_special_tokens: bool = False) -> list[int]:
    """The prompt ids of messages; raises ApiError(400) naming the field at fault."""
    variables = template_variables(body, server_vars)
    check_continuation(body, messages)
    try:
        if allow_special_tokens:
            return tok.encode_prompt(tok.apply_chat_template(
                messages, body.add_generation_prompt, continue_final_message=body.continue_final_message,
                **variables))
        # only the template's own markers are special, never text inside a message
        return tok.encode_chat(messages, body.add_generation_prompt,
                               continue_final_message=body.continue_final_message, **variables)
    except InvalidRequestError as e:
        raise errors.bad_request(str(e), e.field or "messages") from e
