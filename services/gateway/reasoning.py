"""Reasoning models' thinking apart from their answer (`--reasoning-parser`), as vLLM and DeepSeek's
API return it: chat messages get `reasoning_content` beside `content`, and streamed deltas carry one
or the other.

Both parsers read a `<think>...</think>` block at the start of the output:
- `qwen3`: the output is thinking only if it opens the block, or if the rendered prompt already did
  (Qwen3's template with `enable_thinking: false` closes an empty block in the prompt: all content).
- `deepseek_r1`: the output is thinking up to `</think>` even without the opening tag, which
  DeepSeek-R1's template writes into the prompt.
Text after `</think>` is the answer (tool calls are read from it). Output that ends while still
thinking (max_tokens) is all reasoning, with `content` null.

A grammar (structured output, forced tool calls) waits for the thinking, as in vLLM, when the
tokenizer has `<think>` and `</think>` as tokens of their own (`grammar_after_thinking`): the first
token may open the block (or the prompt did), and the grammar applies after its end. Such output is
reasoning only if it opens the block itself or the prompt did, as the engine sees it.

Streaming holds back text that may still be the start of a tag, as stop strings are held back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvrelay.engine.structured.spec import GuidedSpec

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


@dataclass
class _Stream:
    mode: str  # "undecided" (is it opening a block?), "thinking", "answer"
    held: str = ""  # text not handed out yet: it may be part of a tag


@dataclass
class ReasoningSplit:
    """One chat request's split of each choice's output into (reasoning, content)."""

    open_at_start: bool  # the output is thinking before any tag (the prompt opened it, or deepseek_r1)
    streams: dict[int, _Stream] = field(default_factory=dict)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output: (reasoning or None, content or None)."""
        body = text.lstrip()
        thinking = self.open_at_start
        if body.startswith(START):
            thinking, text = True, body[len(START):]
        if not thinking:
            return None, text
        reasoning, end, answer = text.partition(END)
        return reasoning, (answer or None) if end else None

    def feed(self, index: int, text: str, final: bool) -> tuple[str, str]:
        """The next text of choice index: (its reasoning delta, its content delta)."""
        s = self.streams.get(index)
        if s is None:
            s = self.streams[index] = _Stream("undecided")
        s.held += text
        reasoning = ""
        if s.mode == "undecided":
            body = s.held.lstrip()
            if body.startswith(START):
                s.mode, s.held = "thinking", body[len(START):]
            elif START.startswith(body) and not final:  # whitespace, or the tag's start so far
                return "", ""
            else:
                s.mode = "thinking" if self.open_at_start else "answer"
        if s.mode == "thinking":
            before, end, after = s.held.partition(END)
            if not end:
                keep = 0 if final else _partial_tail(s.held, END)
                reasoning, s.held = s.held[: len(s.held) - keep], s.held[len(s.held) - keep:]
                return reasoning, ""
            reasoning, s.mode, s.held = before, "answer", after
        content, s.held = s.held, ""
        return reasoning, content


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _opened(prompt_text: str) -> bool:
    return prompt_text.rstrip().endswith(START)


def plan(parser: str | None, prompt_text: str, constrained: bool) -> ReasoningSplit | None:
    """The split for one chat request; None without a parser. prompt_text: the rendered prompt's end."""
    if parser is None:
        return None
    return ReasoningSplit(_opened(prompt_text) or (parser == "deepseek_r1" and not constrained))


def grammar_after_thinking(spec: GuidedSpec, tokenizer, prompt_text: str) -> GuidedSpec:
    """spec, set to wait for the thinking when the think tags are single tokens (else unchanged)."""
    start, end = tokenizer.token_to_id(START), tokenizer.token_to_id(END)
    if start is None or end is None:
        return spec
    return dataclasses.replace(spec, think_tokens=(start, end), thinking=_opened(prompt_text))
