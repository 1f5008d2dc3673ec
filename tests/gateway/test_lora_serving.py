"""LoRA adapters through the OpenAI API, as vLLM serves them: each adapter is a model of its own
(listed with its parent, chosen by `model`, allowed per tenant), in `kvrelay serve` and across a
prefill/decode hand-off."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai
import pytest
from gateway_helpers import InProcessGateway, write_tenants
from kvrelay.gateway.tenants import hash_key

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from helpers import serve
from lora_adapters import peft_greedy, two_adapters

from kvrelay.models import BUNDLED_MODEL

PROMPT = "Once upon a time, there was a little girl named Lily. She"
N = 10


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    return two_adapters(tmp_path_factory.mktemp("lora"), BUNDLED_MODEL)


@pytest.fixture(scope="module")
def gateway(adapters, tmp_path_factory):
    tenants = write_tenants(tmp_path_factory.mktemp("tenants") / "tenants.yaml", [
        {"id": "base-only", "api_keys_sha256": [hash_key("sk-base")], "allowed_models": ["stories260K"]},
        {"id": "all", "api_keys_sha256": [hash_key("sk-all")]},
    ])
    gw = InProcessGateway(tenants_file=tenants,
                          engine_kwargs={"lora_modules": [f"{k}={v}" for k, v in adapters.items()]})
    yield gw
    gw.stop()


def _client(gw, key: str = "sk-all") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def _expected_text(adapter_dir: str) -> str:
    from kvrelay.engine.tokenizer import Tokenizer

    tok = Tokenizer(BUNDLED_MODEL)
    ids = tok.encode(PROMPT)
    # Decoded after the prompt, as the server's incremental detokenizer does (a leading space stays).
    return tok.decode(ids + peft_greedy(BUNDLED_MODEL, adapter_dir, ids, N))[len(tok.decode(ids)):]


def _complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0,
                                    extra_body={"min_tokens": N})
    return out.choices[0].text


def test_models_lists_each_adapter_with_its_parent(gateway, adapters):
    cards = {m.id: m for m in _client(gateway).models.list().data}
    assert set(cards) == {"stories260K", "attn", "full"}
    assert cards["attn"].parent == "stories260K" and cards["attn"].root == adapters["attn"]
    assert getattr(cards["stories260K"], "parent", None) is None
    assert _client(gateway).models.retrieve("full").parent == "stories260K"


def test_the_model_field_chooses_the_adapter(gateway, adapters):
    client = _client(gateway)
    texts = {m: _complete(client, m) for m in ("stories260K", "attn", "full")}
    assert texts["attn"] == _expected_text(adapters["attn"])
    assert texts["full"] == _expected_text(adapters["full"])
    assert len(set(texts.values())) == 3
    chat = client.chat.completions.create(model="attn", messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    assert chat.model == "attn" and chat.choices[0].message.content


def test_metrics_show_requests_per_adapter(gateway):
    import httpx

    text = httpx.get(gateway.url + "/metrics", headers={"Authorization": "Bearer sk-all"}).text
    for series in ('kvrelay:lora_requests_running{lora="attn"}', 'kvrelay:lora_requests_waiting{lora="full"}'):
        assert any(line.startswith(series + " ") for line in text.splitlines()), text


def test_an_unknown_model_names_the_adapters_and_a_tenant_may_be_kept_from_them(gateway):
    with pytest.raises(openai.NotFoundError, match="attn") as e:
        _complete(_client(gateway), "nope")
    assert e.value.code == "model_not_found"
    base_only = _client(gateway, "sk-base")
    with pytest.raises(openai.PermissionDeniedError, match="may not use model 'attn'"):
        _complete(base_only, "attn")
    assert [m.id for m in base_only.models.list().data] == ["stories260K"]


def test_an_adapter_across_a_prefill_decode_hand_off(gateway, adapters, tmp_path):
    unified = _complete(_client(gateway), "full")
    flags = ["--disaggregated", "--lora-modules", f"full={adapters['full']}", f"attn={adapters['attn']}"]
    with serve(tmp_path / "serve.log", *flags, timeout=180) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert {m.id for m in client.models.list().data} == {"stories260K", "attn", "full"}
        assert _complete(client, "full") == unified
        assert _complete(client, "stories260K") == _complete(_client(gateway), "stories260K")


def test_bench_spreads_its_requests_over_the_adapters(gateway, tmp_path):
    """`kvrelay bench serve --lora-modules a b`: request k asks for the k-th adapter mod 2."""
    from kvrelay.cli import main

    def served(model: str) -> float:
        return sum(s.value for m in gateway.gateway.metrics.registry.collect() if m.name == "kvrelay:request_success"
                   for s in m.samples if s.name.endswith("_total") and s.labels["model"] == model)

    before = {m: served(m) for m in ("attn", "full", "stories260K")}
    rc = main(["bench", "serve", "--base-url", gateway.url, "--api-key", "sk-all", "--lora-modules", "attn", "full",
               "--dataset", "random", "--num-prompts", "6", "--random-input-len", "8", "--random-output-len", "4",
               "--no-progress", "--result-file", str(tmp_path / "r.json")])
    assert rc == 0
    assert {m: served(m) - before[m] for m in before} == {"attn": 3, "full": 3, "stories260K": 0}
    assert json.loads((tmp_path / "r.json").read_text())["config"]["lora_modules"] == ["attn", "full"]
