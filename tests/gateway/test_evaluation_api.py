"""Evaluation through the official `openai` client: lm-evaluation-harness' loglikelihood request (echo,
logprobs, max_tokens 0) returns the prompt's logprobs equal to transformers' log-softmax in fp32;
vLLM's prompt_logprobs; /tokenize and /detokenize."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from kvrelay.models import BUNDLED_MODEL

MODEL = "stories260K"
TEXT = "Once upon a time, there was a little girl named Lily. She loved to play"


@pytest.fixture(scope="module")
def client(open_gateway):
    return openai.OpenAI(base_url=open_gateway.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(open_gateway):
    """(prompt ids, transformers' fp32 log-softmax per position)."""
    import transformers

    ids = httpx.post(open_gateway.url + "/tokenize", json={"model": MODEL, "prompt": TEXT}).json()["tokens"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(BUNDLED_MODEL), dtype=torch.float32).eval()
    with torch.no_grad():
        return ids, model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_lm_eval_loglikelihood_request(client, reference):
    ids, ref = reference
    r = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=2, max_tokens=0, temperature=0.0)
    choice = r.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - float(ref[p - 1, ids[p]])) < 1e-4
        assert len(lp.top_logprobs[p]) <= 2
    # lm-eval's is_greedy: the continuation's tokens are each the top-1 alternative.
    greedy = [max(t, key=t.get) == tok for t, tok in zip(lp.top_logprobs[1:], lp.tokens[1:])]
    assert greedy == [int(ref[p - 1].argmax()) == ids[p] for p in range(1, len(ids))]


def test_echo_logprobs_with_generated_tokens_and_streaming(client, reference):
    ids, ref = reference
    r = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=0, max_tokens=3, temperature=0.0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 3 and r.choices[0].text.startswith(TEXT)
    assert lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=0, max_tokens=0,
                                            temperature=0.0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == TEXT and first.logprobs.token_logprobs[1:] == pytest.approx(
        [float(ref[p - 1, ids[p]]) for p in range(1, len(ids))], abs=1e-4)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_vllm_prompt_logprobs(client, reference):
    ids, ref = reference
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=2, temperature=0.0,
                                  extra_body={"prompt_logprobs": 1})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for p in range(1, len(ids)):
        assert plp[p][str(ids[p])]["logprob"] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4)
        best = int(ref[p - 1].argmax())
        assert plp[p][str(best)]["rank"] == 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          n=2, extra_body={"prompt_logprobs": 0})
    assert all(c.model_extra["prompt_logprobs"][0] is None for c in chat.choices)
    assert chat.choices[0].model_extra["prompt_logprobs"] == chat.choices[1].model_extra["prompt_logprobs"]


def test_max_tokens_0_needs_echo(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=TEXT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_tokenize_and_detokenize(open_gateway, client):
    url = open_gateway.url
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": TEXT, "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 512
    assert client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1).usage.prompt_tokens == r["count"]
    assert httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()["prompt"] == TEXT
    messages = [{"role": "user", "content": "Hello there"}]
    chat_ids = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert usage.prompt_tokens == len(chat_ids)
    bad = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(url + "/tokenize", json={"prompt": "a", "messages": messages})
    assert both.status_code == 400
    assert httpx.post(url + "/tokenize", json={"model": "nope", "prompt": "a"}).status_code == 404
