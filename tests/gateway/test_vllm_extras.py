"""vLLM's extra request fields through the official `openai` client (`extra_body`), over real HTTP:
stop_token_ids, include_stop_str_in_output, skip_special_tokens, truncate_prompt_tokens and the
`stop_reason` of each choice; for chat, chat_template_kwargs, add_generation_prompt and
continue_final_message, which /tokenize renders the same way."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
from gateway_helpers import InProcessGateway

from kvrelay.models import BUNDLED_MODEL

MODEL = "stories260K"
PROMPT = "Once upon a time, there was a little girl named Lily. She loved"
GREEDY = {"model": MODEL, "temperature": 0.0}


@pytest.fixture(scope="module")
def client(open_gateway):
    return openai.OpenAI(base_url=open_gateway.url + "/v1", api_key="unused", max_retries=0)


def _ids(gw, **body) -> list[int]:
    r = httpx.post(gw.url + "/tokenize", json={"model": MODEL} | body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _bad(call, field: str) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.body["param"] == field, e.value.body
    return e.value.body["message"]


def test_stop_strings_end_the_text_with_or_without_themselves(client):
    free = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=24).choices[0].text
    word = free.split()[3]  # a word the greedy continuation reaches
    cut = free.index(word)
    for keep in (False, True):
        kwargs = {**GREEDY, "prompt": PROMPT, "max_tokens": 24, "stop": [word],
                  "extra_body": {"include_stop_str_in_output": keep}}
        choice = client.completions.create(**kwargs).choices[0]
        expected = free[: cut + len(word)] if keep else free[:cut]
        assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (expected, "stop", word)
        streamed = list(client.completions.create(**kwargs, stream=True))
        assert "".join(c.choices[0].text for c in streamed) == expected
        assert streamed[-1].choices[0].model_extra["stop_reason"] == word


def test_stop_token_ids_end_generation_and_are_reported(open_gateway, client):
    free = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=8, logprobs=0).choices[0]
    pieces = [t.replace(" ", "\u2581") for t in free.logprobs.tokens[:3]]  # SentencePiece's word marker
    first, second, stop_id = (open_gateway.gateway.backend.tokenizer.token_to_id(p) for p in pieces)
    assert stop_id is not None and stop_id not in (first, second)
    for keep in (False, True):
        choice = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=8, extra_body={
            "stop_token_ids": [stop_id], "include_stop_str_in_output": keep}).choices[0]
        expected = "".join(free.logprobs.tokens[: 3 if keep else 2])  # the stop token's text only if kept
        assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (expected, "stop", stop_id)
    chat = {**GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    first = client.chat.completions.create(**chat, logprobs=True).choices[0].logprobs.content[0].token
    first_id = open_gateway.gateway.backend.tokenizer.token_to_id(first.replace(" ", "\u2581"))
    stopped = client.chat.completions.create(**chat, extra_body={"stop_token_ids": [first_id]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].message.content == ""
    assert (stopped.choices[0].finish_reason, stopped.choices[0].model_extra["stop_reason"]) == ("stop", first_id)
    assert "512" in _bad(lambda: client.completions.create(
        **GREEDY, prompt=PROMPT, max_tokens=4, extra_body={"stop_token_ids": [512]}), "stop_token_ids")


def test_skip_special_tokens_false_keeps_the_end_of_sequence_text(client):
    """EOS forced by logit_bias: its text shows only with include_stop_str_in_output and
    skip_special_tokens false, as in vLLM."""
    outs = {}
    for skip in (True, False):
        choice = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=4, logit_bias={"2": 100}, extra_body={
            "include_stop_str_in_output": True, "skip_special_tokens": skip}).choices[0]
        assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] is None  # EOS, not a stop id
        outs[skip] = choice.text
    assert outs == {True: "", False: "</s>"}


def test_allowed_token_ids_restrict_what_is_sampled(open_gateway, client):
    tok = open_gateway.gateway.backend.tokenizer
    pieces = [p for p in ("\u2581the", "\u2581a", "\u2581big", "\u2581dog", ".", ",") if tok.token_to_id(p) is not None]
    assert len(pieces) >= 4
    allowed, texts = [tok.token_to_id(p) for p in pieces], {p.replace("\u2581", " ") for p in pieces}
    for kwargs in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 5}):
        choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, logprobs=0, **kwargs,
                                           extra_body={"allowed_token_ids": allowed}).choices[0]
        assert set(choice.logprobs.tokens) <= texts, choice.logprobs.tokens
    chat = client.chat.completions.create(**GREEDY, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          logprobs=True, extra_body={"allowed_token_ids": allowed})
    assert {t.token for t in chat.choices[0].logprobs.content} <= texts
    assert "512" in _bad(lambda: client.completions.create(
        **GREEDY, prompt=PROMPT, max_tokens=2, extra_body={"allowed_token_ids": [512]}), "allowed_token_ids")


def test_bad_words_keep_words_out_of_the_text(client):
    free = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=24).choices[0].text
    words = free.split()[2:4]  # words the greedy continuation reaches
    text = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=24,
                                     extra_body={"bad_words": words}).choices[0].text
    assert text != free and not set(words) & set(text.split()), (words, text)
    assert "bad_words" in _bad(lambda: client.completions.create(
        **GREEDY, prompt=PROMPT, max_tokens=2, extra_body={"bad_words": ["w"] * 101}), "bad_words")


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(open_gateway, client):
    ids = _ids(open_gateway, prompt=PROMPT)
    whole = client.completions.create(**GREEDY, prompt=ids[-6:], max_tokens=8)
    for prompt in (PROMPT, ids):
        cut = client.completions.create(**GREEDY, prompt=prompt, max_tokens=8, echo=True,
                                        extra_body={"truncate_prompt_tokens": 6})
        assert cut.usage.prompt_tokens == 6
        echoed = httpx.post(open_gateway.url + "/detokenize", json={"tokens": ids[-6:]}).json()["prompt"]
        assert cut.choices[0].text == echoed + whole.choices[0].text  # echo shows what the model saw
    chat = client.chat.completions.create(**GREEDY, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    untouched = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": -1})
    assert untouched.usage.prompt_tokens == len(ids)
    _bad(lambda: client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=1,
                                           extra_body={"truncate_prompt_tokens": 0}), "truncate_prompt_tokens")


def test_continue_final_message_continues_the_assistant_turn(open_gateway, client):
    messages = [{"role": "user", "content": "Tell me a story"},
                {"role": "assistant", "content": "Once upon a time, Lily"}]
    fields = {"continue_final_message": True, "add_generation_prompt": False}
    ids = _ids(open_gateway, messages=messages, **fields)
    opened = _ids(open_gateway, messages=messages[:1])  # ends with the assistant turn's opening
    assert ids[: len(opened)] == opened
    assert httpx.post(open_gateway.url + "/detokenize", json={"tokens": ids}).json()["prompt"].endswith(
        "assistant: Once upon a time, Lily")
    chat = client.chat.completions.create(**GREEDY, messages=messages, max_tokens=10, extra_body=fields)
    assert chat.usage.prompt_tokens == len(ids)
    plain = client.completions.create(**GREEDY, prompt=ids, max_tokens=10)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert "add_generation_prompt: false" in _bad(lambda: client.chat.completions.create(
        **GREEDY, messages=messages, max_tokens=2, extra_body={"continue_final_message": True}),
        "continue_final_message")
    _bad(lambda: client.chat.completions.create(**GREEDY, messages=messages[:1], max_tokens=2, extra_body=fields),
         "continue_final_message")


@pytest.fixture(scope="module")
def thinking_gateway(tmp_path_factory):
    """The bundled model with a chat template that reads a request variable, as Qwen3's reads
    enable_thinking."""
    model = tmp_path_factory.mktemp("thinking") / MODEL  # served under its folder's name
    shutil.copytree(BUNDLED_MODEL, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if reasoning_effort is defined %}Effort: {{ reasoning_effort }}\n{% endif %}"
                               "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and "
                               "not enable_thinking %} Quick answer:{% endif %}{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    gw = InProcessGateway(engine_kwargs={"model": str(model)})
    yield gw
    gw.stop()


def test_chat_template_kwargs_reach_the_template(thinking_gateway):
    c = openai.OpenAI(base_url=thinking_gateway.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Tell me a story"}]
    plain = _ids(thinking_gateway, messages=messages)
    quick = _ids(thinking_gateway, messages=messages, chat_template_kwargs={"enable_thinking": False})
    assert quick[: len(plain)] == plain and len(quick) > len(plain)
    tail = httpx.post(thinking_gateway.url + "/detokenize", json={"tokens": quick}).json()["prompt"]
    assert tail.endswith("assistant: Quick answer:")
    for kwargs, expected in (({}, plain), ({"enable_thinking": False}, quick), ({"enable_thinking": True}, plain)):
        chat = c.chat.completions.create(**GREEDY, messages=messages, max_tokens=6,
                                         extra_body={"chat_template_kwargs": kwargs})
        assert chat.usage.prompt_tokens == len(expected)
        assert chat.choices[0].message.content == c.completions.create(
            **GREEDY, prompt=expected, max_tokens=6).choices[0].text
    for name in ("messages", "tools", "add_generation_prompt"):
        assert repr(name) in _bad(lambda name=name: c.chat.completions.create(
            **GREEDY, messages=messages, max_tokens=2, extra_body={"chat_template_kwargs": {name: 1}}),
            "chat_template_kwargs")


def test_reasoning_effort_reaches_the_template_as_a_variable(thinking_gateway):
    """OpenAI's reasoning_effort, as vLLM passes it (gpt-oss's template reads it)."""
    c = openai.OpenAI(base_url=thinking_gateway.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Tell me a story"}]
    ids = _ids(thinking_gateway, messages=messages, reasoning_effort="low")
    text = httpx.post(thinking_gateway.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.startswith("Effort: low\nuser: Tell me a story")
    chat = c.chat.completions.create(**GREEDY, messages=messages, max_tokens=2, reasoning_effort="low")
    assert chat.usage.prompt_tokens == len(ids)
    _bad(lambda: c.chat.completions.create(**GREEDY, messages=messages, max_tokens=2, reasoning_effort="low",
                                           extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}}),
         "chat_template_kwargs")


def test_openai_fields_without_meaning_here_are_accepted(client):
    chat = client.chat.completions.create(**GREEDY, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          store=False, metadata={"team": "a"}, service_tier="auto")
    assert chat.usage.completion_tokens == 2


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    for kind in ("completion", "chat"):
        kwargs = {**GREEDY, "max_tokens": 6, "stream": True,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        chunks = list(client.completions.create(prompt=PROMPT, **kwargs) if kind == "completion" else
                      client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kwargs))
        usages = [c.usage for c in chunks]
        assert all(u is not None for u in usages), kind
        counts = [u.completion_tokens for u in usages]
        assert counts == sorted(counts) and counts[-1] == 6 and counts[0] < 6
        assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
        plain = list(client.completions.create(prompt=PROMPT, **{**kwargs, "stream_options": {
            "continuous_usage_stats": True}})) if kind == "completion" else []
        assert all(c.usage is None for c in plain)  # as in vLLM: only with include_usage


def test_the_chat_template_flag_replaces_the_models_template(tmp_path):
    """--chat-template FILE (GatewayConfig.chat_template): chat requests and /tokenize render with it."""
    from kvrelay.gateway.chat_render import load_template
    from kvrelay.gateway.gateway import GatewayConfig

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant]{% endif %}")
    assert load_template(str(path)) == path.read_text() and load_template("{{ x }}") == "{{ x }}"
    gw = InProcessGateway(config=GatewayConfig(chat_template=load_template(str(path))))
    try:
        messages = [{"role": "user", "content": "Tell me a story"}]
        ids = _ids(gw, messages=messages)
        text = httpx.post(gw.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text == "[user] Tell me a story\n[assistant]"
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        chat = c.chat.completions.create(**GREEDY, messages=messages, max_tokens=6)
        assert chat.usage.prompt_tokens == len(ids)
        assert chat.choices[0].message.content == c.completions.create(**GREEDY, prompt=ids, max_tokens=6).choices[0].text
    finally:
        gw.stop()


def test_a_template_variable_of_the_wrong_type_is_a_400(tmp_path):
    """A variable the template uses as a number, sent as a string, fails inside jinja2 with a
    Python TypeError: that is the request's fault, a 400, not a 500."""
    from kvrelay.engine.errors import InvalidRequestError
    from kvrelay.engine.tokenizer import Tokenizer

    model = tmp_path / "m"
    shutil.copytree(BUNDLED_MODEL, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0].content }}{{ budget + 1 }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(model)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], budget=1) == "x2"
    with pytest.raises(InvalidRequestError, match="cannot render them: TypeError"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], budget="1")
