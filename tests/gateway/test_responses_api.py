"""POST /v1/responses through the official `openai` client: the same generation as the chat path it
maps to, as a Response object or its stream of events; function calls out and back; errors that
name the field."""

from __future__ import annotations

import json

import openai
import pytest
from kvrelay.gateway.responses_api import ResponsesRequest, messages_of

MODEL = "stories260K"
GREEDY = {"model": MODEL, "temperature": 0.0}
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(open_gateway):
    return openai.OpenAI(base_url=open_gateway.url + "/v1", api_key="unused", max_retries=0)


def _chat_text(client, messages, max_tokens):
    return client.chat.completions.create(**GREEDY, messages=messages, max_tokens=max_tokens).choices[0].message.content


def test_text_equals_the_chat_answer_and_reports_why_it_ended(client):
    r = client.responses.create(**GREEDY, input="Tell me a story", instructions="Be brief.", max_output_tokens=12)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    assert r.output_text == _chat_text(client, messages, 12)
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert r.usage.output_tokens == 12 and r.usage.total_tokens == r.usage.input_tokens + 12
    assert [o.type for o in r.output] == ["message"] and r.output[0].status == "incomplete"


def test_the_stream_opens_adds_and_closes_each_item(client):
    kwargs = {**GREEDY, "input": "Tell me a story", "max_output_tokens": 16}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == whole.output_text == final.output_text and final.status == "incomplete"
    assert final.output[0].id == events[2].item.id == events[-2].item.id  # the streamed item, ids kept
    assert final.usage.output_tokens == 16


def test_function_calls_out_and_their_results_back(client):
    kwargs = {**GREEDY, "input": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
              "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 200}
    r = client.responses.create(**kwargs)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    events = list(client.responses.create(**kwargs, stream=True))
    added = next(e.item for e in events if e.type == "response.output_item.added")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    final = events[-1].response.output[0]
    assert added.type == "function_call" and added.call_id == final.call_id and added.name == "get_weather"
    assert arguments == final.arguments == call.arguments
    # The call and its output go back as items; the answer equals the chat path's.
    back = client.responses.create(**GREEDY, max_output_tokens=8, input=[
        kwargs["input"][0], call.model_dump(exclude_unset=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    messages = [kwargs["input"][0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 C"}]
    assert back.output_text == _chat_text(client, messages, 8)


def test_a_json_schema_format_constrains_the_text(client):
    schema = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"],
              "additionalProperties": False}
    r = client.responses.create(**GREEDY, input="How are you?", max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "mood", "schema": schema}})
    assert r.status == "completed" and r.incomplete_details is None  # the grammar ended it: EOS
    assert json.loads(r.output_text)["mood"] in ("happy", "sad")


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is"},
                                             {"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[1]"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
])
def test_bad_requests_name_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{**GREEDY, "input": "hi", "max_output_tokens": 4, **extra})
    assert e.value.body["param"] == param, e.value.body


def test_input_items_become_the_chat_conversation():
    body = ResponsesRequest.model_validate({"model": MODEL, "instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask it."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "id": "fc_2", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}]})
    assert messages_of(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Ask it.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]


def test_text_then_a_call_streams_as_a_message_item_then_a_function_call_item(open_gateway):
    """What an `auto` tool parser streams (text, then a call at the end) becomes a message item closed
    before the function_call item opens; the completed Response holds both with the streamed ids."""
    from kvrelay.gateway.responses_api import to_chat
    from kvrelay.gateway.responses_writer import ResponsesResponse

    gateway = open_gateway.gateway
    body = ResponsesRequest.model_validate({"model": MODEL, "input": "hi", "stream": True})
    writer = ResponsesResponse(gateway, gateway._prepare_chat(to_chat(body), gateway.tenants.authenticate(None)), {})
    deltas = [{"role": "assistant", "content": ""}, {"content": "Sure, "}, {"content": "checking."},
              {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Rome"}'}}]}]
    wire = writer._opening() + b"".join(writer._event({"index": 0, "delta": d}) for d in deltas) + writer._closing()
    events = [json.loads(block.split("\ndata: ", 1)[1]) for block in wire.decode().strip().split("\n\n")]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    message, call = events[-1]["response"]["output"]
    assert message["content"][0]["text"] == "Sure, checking." and message["id"] == events[2]["item"]["id"]
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "get_weather", '{"city": "Rome"}')
    assert call["id"] == events[9]["item"]["id"] and events[9]["output_index"] == 1
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
