"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter on a real `kvrelay serve` (its engine in
a process of its own) with --allow-runtime-lora-updating, through the official openai client."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from gateway_helpers import GatewayProcess

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from lora_adapters import ALL_LINEAR, peft_greedy, save_adapter

from kvrelay.models import BUNDLED_MODEL

PROMPT = "Once upon a time, there was a little girl named Lily. She"
N = 8
KEY = "sk-admin"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(save_adapter(BUNDLED_MODEL, tmp_path_factory.mktemp("lora") / "full", ALL_LINEAR, r=8, alpha=16,
                            seed=2, scale=0.3))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = GatewayProcess(["--allow-runtime-lora-updating", "--api-key", KEY],
                          tmp_path_factory.mktemp("serve") / "serve.log")
    yield proc
    proc.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def _complete(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0,
                                     extra_body={"min_tokens": N}).choices[0].text


def test_load_use_and_unload_an_adapter(server, folder):
    from kvrelay.engine.tokenizer import Tokenizer

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["stories260K"]
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": folder})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
    card = client.models.retrieve("sql")
    assert card.parent == "stories260K" and card.root == folder
    tok = Tokenizer(BUNDLED_MODEL)
    ids = tok.encode(PROMPT)
    expected = tok.decode(ids + peft_greedy(BUNDLED_MODEL, folder, ids, N))[len(tok.decode(ids)):]
    assert _complete(client, "sql") == expected != _complete(client, "stories260K")

    again = _post(server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": folder})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = _post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(Path(folder).parent)})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]

    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "sql")
    gone = _post(server, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_not_found"
    unauthorized = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": folder})
    assert unauthorized.status_code == 401


def test_without_the_flag_the_routes_do_not_exist(tmp_path, folder):
    proc = GatewayProcess([], tmp_path / "serve.log")
    try:
        assert httpx.post(proc.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": folder}
                          ).status_code == 404
    finally:
        proc.stop()


def test_the_flag_refuses_a_tenants_file(tmp_path):
    tenants = tmp_path / "t.yaml"
    tenants.write_text("tenants: []\n")
    out = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--allow-runtime-lora-updating", "--tenants",
                          str(tenants), "--port", "0"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode != 0 and "not with --tenants" in out.stderr
