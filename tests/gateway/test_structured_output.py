"""Structured output through the official `openai` client against a real server (bundled model).

Outputs of seeded temperature-1.0 samples are checked with `jsonschema`, streaming and not, n=3.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

# Nested, with enums, arrays and required fields; bounded so the tiny model always finishes.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "sleepy"]},
        "pets": {"type": "array", "maxItems": 2, "items": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
            "required": ["kind", "legs"], "additionalProperties": False}},
    },
    "required": ["name", "age", "mood", "pets"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MESSAGES = [{"role": "user", "content": "Tell me about Lily."}]


@pytest.fixture(scope="module")
def client(open_gateway):
    return openai.OpenAI(base_url=open_gateway.url + "/v1", api_key="unused", max_retries=0)


def _check_person(text: str, finish_reason: str) -> None:
    assert finish_reason == "stop", text
    jsonschema.validate(json.loads(text), PERSON)


def test_json_schema_seeded_samples_are_valid(client):
    r = client.chat.completions.create(model="stories260K", messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                       temperature=1.0, seed=7, n=3, max_tokens=200)
    texts = [c.message.content for c in r.choices]
    for c in r.choices:
        _check_person(c.message.content, c.finish_reason)
    assert len(set(texts)) > 1  # really sampled


def test_json_schema_streaming_n3(client):
    stream = client.chat.completions.create(model="stories260K", messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                            temperature=1.0, seed=11, n=3, max_tokens=200, stream=True)
    texts, reasons = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert sorted(texts) == [0, 1, 2]
    for i, text in texts.items():
        _check_person(text, reasons[i])
    # The same seed gives the same samples without streaming.
    again = client.chat.completions.create(model="stories260K", messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                           temperature=1.0, seed=11, n=3, max_tokens=200)
    assert [c.message.content for c in again.choices] == [texts[i] for i in range(3)]


def test_json_object_top_p_and_stop_strings(client):
    r = client.chat.completions.create(model="stories260K", messages=MESSAGES, temperature=1.0, top_p=0.9, seed=3,
                                       response_format={"type": "json_object"}, max_tokens=64,
                                       extra_body={"structured_outputs": None})
    text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert text.startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: reported as such, never claimed valid
        assert reason == "length" and r.usage.completion_tokens == 64


def test_cut_by_length_says_length(client):
    r = client.chat.completions.create(model="stories260K", messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                       temperature=0.0, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


def test_regex_choice_grammar_and_structured_outputs(client):
    r = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=20, temperature=1.0,
                                  seed=5, n=3, extra_body={"guided_regex": r"[A-Z][a-z]{2,6} (cat|dog)"})
    for c in r.choices:
        assert re.fullmatch(r"[A-Z][a-z]{2,6} (cat|dog)", c.text) and c.finish_reason == "stop", c.text
    r = client.chat.completions.create(model="stories260K", messages=MESSAGES, temperature=1.0, seed=1, n=3,
                                       extra_body={"guided_choice": ["red fox", "blue whale", "green frog"]})
    assert all(c.message.content in ("red fox", "blue whale", "green frog") for c in r.choices)
    grammar = 'root ::= "The " animal " is " ("big" | "small")\nanimal ::= "cat" | "dog" | "bird"'
    r = client.completions.create(model="stories260K", prompt="Lily", max_tokens=20, temperature=1.0, seed=2, n=3,
                                  extra_body={"guided_grammar": grammar})
    for c in r.choices:
        assert re.fullmatch(r"The (cat|dog|bird) is (big|small)", c.text), c.text
    r = client.completions.create(model="stories260K", prompt="Lily", max_tokens=30, temperature=0.0,
                                  extra_body={"structured_outputs": {"json": {"type": "array", "maxItems": 3,
                                                                              "items": {"type": "boolean"}}}})
    assert all(isinstance(x, bool) for x in json.loads(r.choices[0].text))


def test_stop_string_inside_the_constraint_ends_early(client):
    r = client.completions.create(model="stories260K", prompt="Once", max_tokens=20, temperature=0.0,
                                  stop=[" is"], extra_body={"guided_regex": "The (cat|dog) is big"})
    assert r.choices[0].text in ("The cat", "The dog") and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("extra", "field"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "guided_json"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_grammar": "root ::= (("}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "json_object": True}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_rejected_constraints_are_400_naming_the_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert e.value.body["param"] == field or e.value.body["param"].startswith(field), e.value.body


def test_compiled_once_per_schema(open_gateway, client):
    compiler = open_gateway.engine.engine.grammars
    before = compiler.compiled
    schema = {"type": "object", "properties": {"k": {"const": "only-once"}}, "required": ["k"],
              "additionalProperties": False}
    for _ in range(3):
        r = client.completions.create(model="stories260K", prompt="A", max_tokens=80, temperature=0.0,
                                      extra_body={"guided_json": schema})
        assert json.loads(r.choices[0].text) == {"k": "only-once"}
    assert compiler.compiled == before + 1
