"""--served-model-name NAME ALIAS...: the gateway accepts and lists every name and answers as the
first (vLLM's behaviour); a tenant allowed the model may use its aliases."""

from __future__ import annotations

import argparse

import openai
import pytest
from gateway_helpers import InProcessGateway, write_tenants
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.gateway.tenants import hash_key

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tenants = write_tenants(tmp_path_factory.mktemp("tenants") / "t.yaml", [
        {"id": "model", "api_keys_sha256": [hash_key("sk-model")], "allowed_models": ["llama"]},
        {"id": "alias", "api_keys_sha256": [hash_key("sk-alias")], "allowed_models": ["default"]},
    ])
    gw = InProcessGateway(tenants_file=tenants,
                          engine_kwargs={"served_model_name": "llama", "served_model_aliases": ("gpt-mini", "default")})
    yield gw
    gw.stop()


def _client(gw, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def test_every_name_is_listed_and_answered_as_the_first(gateway):
    client = _client(gateway, "sk-model")
    assert [m.id for m in client.models.list().data] == ["llama", "gpt-mini", "default"]
    texts = set()
    for name in ("llama", "gpt-mini"):
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0)
        assert out.model == "llama"
        texts.add(out.choices[0].text)
    assert len(texts) == 1
    with pytest.raises(openai.NotFoundError, match="gpt-mini"):
        client.completions.create(model="other", prompt=PROMPT, max_tokens=2)


def test_an_alias_is_allowed_where_the_model_is_not_the_other_way_round(gateway):
    alias_only = _client(gateway, "sk-alias")
    assert [m.id for m in alias_only.models.list().data] == ["default"]
    assert alias_only.completions.create(model="default", prompt=PROMPT, max_tokens=2).model == "llama"
    for name in ("llama", "gpt-mini"):
        with pytest.raises(openai.PermissionDeniedError):
            alias_only.completions.create(model=name, prompt=PROMPT, max_tokens=2)


def test_the_flag_takes_several_names():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli(parser.parse_args(["--served-model-name", "llama", "gpt-mini"]))
    assert (args.served_model_name, args.served_model_aliases) == ("llama", ("gpt-mini",))
    assert EngineArgs.cli_flags(parser.parse_args(["--served-model-name", "llama", "gpt-mini"])) == [
        "--served-model-name", "llama", "gpt-mini"]
    assert EngineArgs.from_cli(parser.parse_args([])).served_model_name is None
