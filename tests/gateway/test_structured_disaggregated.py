"""Structured output through real prefill and decode worker processes: the constraint crosses the
gRPC hop in the sampling params, the prefill worker masks the first token and the decode worker
masks the rest, so outputs equal the single-process server's for the same seed."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from gateway_helpers import InProcessGateway, WorkerProcess, wait_for_workers
from kvrelay.gateway.disaggregated import DisaggregatedBackend
from test_structured_output import MESSAGES, PERSON, RESPONSE_FORMAT

from kvrelay.models import BUNDLED_MODEL

MODEL = "stories260K"


@pytest.fixture(scope="module")
def cluster():
    started = []
    gw = None
    try:
        for role in ("prefill", "decode"):
            started.append(WorkerProcess(role))
        backend = DisaggregatedBackend(started[0].address, started[1].address, str(BUNDLED_MODEL))
        gw = InProcessGateway(backend=backend)
        wait_for_workers(backend)
        yield gw, started
    finally:
        if gw is not None:
            gw.stop()
        for w in started:
            w.stop()


def test_json_schema_through_the_workers_equals_serve(cluster, open_gateway):
    gw, (prefill, _decode) = cluster
    remote = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    local = openai.OpenAI(base_url=open_gateway.url + "/v1", api_key="x", max_retries=0)
    for seed in (1, 2, 3):
        kwargs = {"model": MODEL, "messages": MESSAGES, "response_format": RESPONSE_FORMAT, "temperature": 1.0,
                  "seed": seed, "max_tokens": 200}
        r = remote.chat.completions.create(**kwargs)
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == local.chat.completions.create(**kwargs).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in remote.chat.completions.create(
            **kwargs, stream=True) if c.choices)
        assert streamed == r.choices[0].message.content
    assert prefill.generation_tokens() >= 3  # the first tokens really came from the prefill worker


def test_rejected_schema_is_400_at_the_cluster_gateway(cluster):
    gw, _ = cluster
    remote = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        remote.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       extra_body={"guided_regex": "(unclosed"})
    assert e.value.body["param"] == "guided_regex"


def test_required_tool_call_and_prompt_logprobs_through_the_workers(cluster):
    from test_tool_calling import MESSAGES as TOOL_MESSAGES
    from test_tool_calling import SCHEMAS, TOOLS

    gw, _ = cluster
    remote = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    r = remote.chat.completions.create(model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=1.0, seed=4, max_tokens=80)
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    scored = remote.completions.create(model=MODEL, prompt="Once upon a time", echo=True, logprobs=1, max_tokens=0)
    lp = scored.choices[0].logprobs  # scored on the prefill worker (test_prompt_logprobs_disaggregated.py)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) > 2 and all(lp.token_logprobs[1:])
