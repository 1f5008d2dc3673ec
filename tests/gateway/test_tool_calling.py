"""Tool calling through the official `openai` client against a real server (bundled model, whose chat
template has no tool support: the tools reach it in the default system message, and `required` or
named calls still come back valid through the grammar)."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
from gateway_helpers import InProcessGateway
from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.gateway.gateway import GatewayConfig
from kvrelay.gateway.schemas import ChatCompletionRequest
from kvrelay.gateway.structured import tools as tool_calling
from kvrelay.gateway.structured.tool_parsers import get_parser

from kvrelay.models import BUNDLED_MODEL

MODEL = "stories260K"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def auto_gateway():
    gw = InProcessGateway(config=GatewayConfig(tools=tool_calling.ToolSettings("hermes", True)))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def client(open_gateway):
    return openai.OpenAI(base_url=open_gateway.url + "/v1", api_key="unused", max_retries=0)


def _check_calls(message, allow_many: bool = True) -> None:
    assert message.tool_calls, message
    assert allow_many or len(message.tool_calls) == 1
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_returns_valid_calls_for_seeded_samples(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=1.0, seed=4, n=3, max_tokens=80)
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        assert c.message.content is None
        _check_calls(c.message, allow_many=False)
    assert len({c.message.tool_calls[0].function.arguments for c in r.choices}) > 1  # really sampled


def test_parallel_calls_are_allowed_and_a_cut_list_is_not_claimed(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=4, n=3, max_tokens=80)
    # The tiny model keeps adding calls: each answer is cut by max_tokens, and then it is text, not calls.
    assert any('}}, {"name": ' in (c.message.content or "") for c in r.choices)
    for c in r.choices:
        if c.finish_reason == "tool_calls":
            _check_calls(c.message)
        else:
            assert c.finish_reason == "length" and c.message.tool_calls is None
    two = '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {}}]'
    message, reason = tool_calling.ToolPlan("required", tool_calling.ToolSettings()).final(two, "stop")
    assert reason == "tool_calls" and [c["function"]["name"] for c in message["tool_calls"]] == [
        "get_time", "get_weather"]


def test_named_function_is_called(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                       temperature=1.0, seed=9, max_tokens=80)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "stop"
    _check_calls(r.choices[0].message)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_reassemble_in_the_client(client, tool_choice):
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice,
              "parallel_tool_calls": False, "temperature": 1.0, "seed": 21, "max_tokens": 80}
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    expected = client.chat.completions.create(**kwargs).choices[0]
    got = final.choices[0]
    assert got.finish_reason == expected.finish_reason
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in expected.message.tool_calls]
    _check_calls(got.message)


def test_multi_turn_tool_conversation(client):
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0.0, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            temperature=0.0, max_tokens=10)
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_history_and_default_system_message_render_through_the_template():
    tok = Tokenizer(BUNDLED_MODEL)
    assert not tool_calling.template_reads_tools(tok)
    body = ChatCompletionRequest.model_validate({"model": MODEL, "tools": TOOLS, "tool_choice": "required", "messages": [
        *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]})
    rendered = [{"role": m.role, "content": m.content or ""} for m in body.messages]
    plan, messages, extra = tool_calling.plan(body, tool_calling.ToolSettings("hermes"), tok, rendered)
    text = tok.apply_chat_template(messages, **extra)
    assert text.startswith("system: Tools:\n")
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}' in text
    assert "tool: 21 degrees" in text
    assert plan.constraint(body.tools, True).kind == "json"


def test_a_template_that_reads_tools_gets_them(tmp_path):
    model = tmp_path / "m"
    shutil.copytree(BUNDLED_MODEL, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}"
                               "{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %} CALL "
                               "{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}\n{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(model)
    assert tool_calling.template_reads_tools(tok)
    body = ChatCompletionRequest.model_validate({"model": MODEL, "tools": TOOLS, "messages": [
        *MESSAGES, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]}]})
    rendered = [{"role": m.role, "content": m.content or ""} for m in body.messages]
    _, messages, extra = tool_calling.plan(body, tool_calling.ToolSettings(), tok, rendered)
    text = tok.apply_chat_template(messages, add_generation_prompt=False, **extra)
    assert text.startswith("TOOL get_weather\nTOOL get_time\nuser:") and "CALL get_weather(Oslo)" in text


@pytest.mark.parametrize(("extra", "field"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),  # the server runs without --enable-auto-tool-choice
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tool_choice"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert e.value.body["param"] == field, e.value.body


def test_auto_without_a_call_streams_the_same_text(auto_gateway):
    c = openai.OpenAI(base_url=auto_gateway.url + "/v1", api_key="unused", max_retries=0)
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "temperature": 0.0, "max_tokens": 20}
    plain = c.chat.completions.create(**kwargs).choices[0]
    assert plain.message.tool_calls is None and plain.message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kwargs, stream=True)
                       if ch.choices)
    assert streamed == plain.message.content


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_parsers_read_what_they_render(name):
    parser = get_parser(name)
    calls = [("get_weather", {"city": "Rome", "unit": "C"}), ("get_time", {"zone": "UTC"})]
    content, parsed = parser.parse(parser.render(calls))
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    assert parser.parse("just words")[1] == []
    assert parser.parse(parser.render(calls)[:-3])[1] == []  # a cut call is text, not a call


def test_pythonic_reads_literals_and_runs_nothing():
    parser = get_parser("pythonic")
    content, calls = parser.parse('<|python_start|>[search(query="café", limit=3, exact=True, tags=["a", None]), '
                                  "now()]<|python_end|>")
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("search", {"query": "café", "limit": 3, "exact": True, "tags": ["a", None]}), ("now", {})]
    for text in ('[__import__("os").system("true")]', "[f(x=open('/etc/passwd'))]", "[f(1)]", "[f(**{'a': 1})]",
                 "[a.b(x=1)]", "[f(x={1, 2})]", "[]", "[f(x=1)", "[" * 5000 + "]" * 5000, "[f(x=1)] and more"):
        assert parser.parse(text) == (text, []), text  # not a list of literal calls: text


def test_pythonic_calls_through_the_server_streamed_or_not():
    """--tool-call-parser pythonic with tool_choice auto; the tiny model's answer forced by a regex."""
    gw = InProcessGateway(config=GatewayConfig(tools=tool_calling.ToolSettings("pythonic", True)))
    try:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        kwargs = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 80,
                  "temperature": 0.0, "extra_body": {"guided_regex": r'\[get_weather\(city="Paris", unit="C"\)\]'}}
        whole = c.chat.completions.create(**kwargs).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        call = whole.message.tool_calls[0].function
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "unit": "C"})
        streamed = [t for ch in c.chat.completions.create(**kwargs, stream=True) if ch.choices
                    for t in ch.choices[0].delta.tool_calls or []]
        assert [t.function.name for t in streamed if t.function.name] == ["get_weather"]
        assert json.loads("".join(t.function.arguments or "" for t in streamed)) == {"city": "Paris", "unit": "C"}
    finally:
        gw.stop()


def test_hermes_keeps_text_before_the_calls():
    content, calls = get_parser("hermes").parse('Let me check.\n<tool_call>\n{"name": "f", "arguments": {}}\n'
                                                "</tool_call>")
    assert content == "Let me check." and calls[0].name == "f" and calls[0].arguments == "{}"


def test_auto_stream_holds_back_a_call_and_sends_openai_deltas():
    plan = tool_calling.ToolPlan("auto", tool_calling.ToolSettings("hermes", True))
    text = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    sent = []
    for k in range(0, len(text), 7):
        deltas, reason = plan.stream(0, text[k : k + 7], None)
        sent += deltas
        assert reason is None
    assert [d for d in sent if "tool_calls" in d] == []  # nothing of the call leaks as it streams
    deltas, reason = plan.stream(0, "", "stop")
    assert reason == "tool_calls"
    content = "".join(d.get("content", "") for d in sent + deltas)
    assert content.strip() == "Sure."
    opening, args = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert opening["function"] == {"name": "get_time", "arguments": ""} and opening["id"].startswith("call_")
    assert args == {"index": 0, "function": {"arguments": '{"zone": "UTC"}'}}
    plain = tool_calling.ToolPlan("auto", tool_calling.ToolSettings("hermes", True))
    assert plain.stream(0, "Once upon", None) == ([{"content": "Once upon"}], None)  # cannot be a call
