"""--reasoning-parser: a reasoning model's <think> block goes to `reasoning_content`, its answer to
`content` (and tool calls are read from the answer), streamed or not, through the official client."""

from __future__ import annotations

import random

import openai
import pytest
from gateway_helpers import InProcessGateway
from kvrelay.gateway.gateway import GatewayConfig
from kvrelay.gateway.reasoning import ReasoningSplit, plan
from kvrelay.gateway.structured.tools import ToolSettings

MODEL = "stories260K"

CASES = [  # (output, opened at the start, expected (reasoning, content))
    ("<think>plan it</think>The answer", False, ("plan it", "The answer")),
    ("\n <think>plan</think>\n\nAnswer", False, ("plan", "\n\nAnswer")),
    ("No thinking here", False, (None, "No thinking here")),
    ("plan it</think>The answer", True, ("plan it", "The answer")),
    ("<think>still thinking when cut", False, ("still thinking when cut", None)),
    ("thinking, opened by the prompt", True, ("thinking, opened by the prompt", None)),
    ("<think>all thought</think>", False, ("all thought", None)),
    ("<thin", False, (None, "<thin")),
    ("Text with </think> but no block", False, (None, "Text with </think> but no block")),
    ("", False, (None, "")),
]


@pytest.mark.parametrize(("text", "opened", "expected"), CASES)
def test_streamed_pieces_add_up_to_the_whole_split(text, opened, expected):
    assert ReasoningSplit(opened).split(text) == expected
    rng = random.Random(len(text))
    for trial in range(30):  # every cut into 1..4-character pieces, tags split anywhere
        split, pieces, i = ReasoningSplit(opened), [], 0
        while i < len(text):
            n = 1 if trial == 0 else rng.randint(1, 4)
            pieces.append(text[i:i + n])
            i += n
        pieces.append("")  # the final output brings no text
        thought, answer = "", ""
        for k, piece in enumerate(pieces):
            r, c = split.feed(0, piece, final=k == len(pieces) - 1)
            thought, answer = thought + r, answer + c
            assert "<" not in r  # no piece of a tag is ever sent on as thinking
        want_thought, want_answer = expected
        assert (thought, answer) == (want_thought or "", want_answer or ""), pieces


def test_which_outputs_open_thinking():
    assert plan(None, "assistant:", False) is None
    assert not plan("qwen3", "assistant:", False).open_at_start
    assert plan("qwen3", "assistant: <think>\n", False).open_at_start  # the template opened the block
    assert plan("deepseek_r1", "assistant:", False).open_at_start  # R1 may leave out the opening tag
    assert not plan("deepseek_r1", "assistant:", True).open_at_start  # a grammar's output is the answer


def _client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def qwen3_gateway():
    gw = InProcessGateway(config=GatewayConfig(reasoning_parser="qwen3", tools=ToolSettings("hermes", True)))
    yield gw
    gw.stop()


def _streamed(client, **kwargs) -> tuple[str, str, list]:
    thought, answer, calls = "", "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            thought += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            answer += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
    return thought, answer, calls


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# The tiny model never thinks on its own: a regex makes its output a think block and an answer.
THINK_THEN_ANSWER = "<think>[a-z ]{8,30}</think>[a-z ]{4,20}"


def test_thinking_and_answer_apart_streamed_or_not(qwen3_gateway):
    c = _client(qwen3_gateway)
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "temperature": 0.0,
              "extra_body": {"guided_regex": THINK_THEN_ANSWER}}
    whole = c.chat.completions.create(**kwargs).choices[0]
    thought, answer = whole.message.model_extra["reasoning_content"], whole.message.content
    assert whole.finish_reason == "stop" and thought and answer and "<think>" not in thought + answer
    assert _streamed(c, **kwargs) == (thought, answer, [])
    plain = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.0).choices[0]
    assert plain.message.content and plain.message.model_extra.get("reasoning_content") is None  # qwen3: no block
    cut = c.chat.completions.create(**{**kwargs, "max_tokens": 12, "extra_body": {  # stopped while thinking
        "guided_regex": "<think>[a-z ]{60,80}</think>[a-z ]{4,20}"}}).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    assert cut.message.model_extra["reasoning_content"]


def test_tool_calls_are_read_from_the_answer_after_the_thinking(qwen3_gateway):
    c = _client(qwen3_gateway)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    call = '<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}</tool_call>'
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0.0, "tools": tools,
              "tool_choice": "auto", "extra_body": {"guided_regex": "<think>[a-z ]{8,20}</think>" + call}}
    whole = c.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert [(t.function.name, t.function.arguments) for t in whole.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    thought, answer, calls = _streamed(c, **kwargs)
    assert thought == whole.message.model_extra["reasoning_content"] and answer == ""
    assert [t.function.name for t in calls if t.function and t.function.name] == ["get_weather"]


def test_a_template_that_opens_the_block_makes_the_output_thinking(tmp_path):
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: <think>\n{% endif %}")
    gw = InProcessGateway(config=GatewayConfig(reasoning_parser="qwen3", chat_template=template))
    try:
        c = _client(gw)
        kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "temperature": 0.0,
                  "extra_body": {"guided_regex": "[a-z ]{8,30}</think>[a-z ]{4,20}"}}
        message = c.chat.completions.create(**kwargs).choices[0].message
        assert message.model_extra["reasoning_content"] and message.content
        assert "</think>" not in message.model_extra["reasoning_content"] + message.content
        assert _streamed(c, **kwargs) == (message.model_extra["reasoning_content"], message.content, [])
    finally:
        gw.stop()


def test_a_reply_appended_to_the_history_as_returned_is_accepted(qwen3_gateway):
    """The common client loop, `messages.append(response.choices[0].message)`, sends back the reply's
    own fields (reasoning_content among them): the next turn is served, and a template that reads
    the thinking gets it."""
    c = _client(qwen3_gateway)
    messages = list(MESSAGES)
    reply = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0.0,
                                      extra_body={"guided_regex": THINK_THEN_ANSWER}).choices[0].message
    assert reply.model_extra["reasoning_content"]
    messages += [reply, {"role": "user", "content": "And tomorrow?"}]
    nxt = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert nxt.choices[0].finish_reason == "length"
    from kvrelay.gateway.chat_render import template_messages
    from kvrelay.gateway.schemas import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
        MESSAGES[0], reply.model_dump(exclude_unset=True)]})
    assert template_messages(body.messages)[1]["reasoning_content"] == reply.model_extra["reasoning_content"]
    for field, value in (("function_call", {"name": "f", "arguments": "{}"}), ("audio", {"id": "a"})):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                MESSAGES[0], {"role": "assistant", "content": "x", field: value}, {"role": "user", "content": "y"}])
        assert e.value.body["param"] == f"messages[1].{field}" and "not supported" in e.value.body["message"]


def test_a_grammar_waits_for_the_thinking_when_the_tags_are_tokens(tmp_path):
    """With <think> and </think> in the vocabulary the grammar is set to wait for the thinking (the
    engine's side: tests/engine/test_structured_thinking.py); without them it is left alone."""
    import json
    import shutil

    from kvrelay.engine.structured.spec import GuidedSpec
    from kvrelay.engine.tokenizer import Tokenizer
    from kvrelay.gateway.reasoning import grammar_after_thinking

    from kvrelay.models import BUNDLED_MODEL

    spec = GuidedSpec("json", "{}", "response_format")
    assert grammar_after_thinking(spec, Tokenizer(BUNDLED_MODEL), "assistant: <think>\n") is spec
    model = tmp_path / "m"
    shutil.copytree(BUNDLED_MODEL, model)
    config = json.loads((model / "tokenizer.json").read_text())
    config["added_tokens"] += [{"id": 512 + i, "content": tag, "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": False}
                               for i, tag in enumerate(("<think>", "</think>"))]
    (model / "tokenizer.json").write_text(json.dumps(config))
    tok = Tokenizer(model)
    opened = grammar_after_thinking(spec, tok, "assistant: <think>\n")
    assert (opened.think_tokens, opened.thinking, opened.key()) == ((512, 513), True, spec.key())
    assert grammar_after_thinking(spec, tok, "assistant:").thinking is False


def test_the_responses_api_carries_the_thinking_as_a_reasoning_item():
    """A template that opens the block and output that never closes it: all thinking, a `reasoning`
    item (streamed as reasoning_text events) and no message."""
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: <think>\n{% endif %}")
    gw = InProcessGateway(config=GatewayConfig(reasoning_parser="qwen3", chat_template=template))
    try:
        c = _client(gw)
        kwargs = {"model": MODEL, "input": "Tell me a story", "max_output_tokens": 10, "temperature": 0.0}
        r = c.responses.create(**kwargs)
        thought = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}],
                                            max_tokens=10, temperature=0.0).choices[0].message
        assert [o.type for o in r.output] == ["reasoning"] and thought.content is None
        assert r.output[0].content[0].text == thought.model_extra["reasoning_content"]
        events = list(c.responses.create(**kwargs, stream=True))
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert deltas == r.output[0].content[0].text == events[-1].response.output[0].content[0].text
        assert {e.type for e in events} >= {"response.output_item.added", "response.reasoning_text.done",
                                            "response.output_item.done", "response.completed"}
    finally:
        gw.stop()
