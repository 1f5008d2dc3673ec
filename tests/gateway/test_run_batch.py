"""`kvrelay run-batch`: OpenAI's batch file format answered offline, line for line as the HTTP
server answers, with per-line errors that stop nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from embedding_models import hf_vectors
from kvrelay.engine.tokenizer import Tokenizer

from kvrelay.models import BUNDLED_MODEL

COMPLETION = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
CHAT = {"model": "stories260K", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}


def run_batch(tmp_path: Path, lines: list, *flags: str) -> list[dict]:
    source, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    done = subprocess.run([sys.executable, "-m", "kvrelay.cli", "run-batch", "-i", str(source), "-o", str(out), *flags],
                          check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_a_batch_is_answered_as_the_server_answers(tmp_path, open_gateway):
    lines = [
        {"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": COMPLETION},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {**COMPLETION, "max_tokens": -1}},
        {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"model": "stories260K", "input": "x"}},
        {"custom_id": "img", "method": "POST", "url": "/v1/images/generations", "body": {}},
        {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": COMPLETION},
        {"custom_id": "stream", "method": "POST", "url": "/v1/completions", "body": {**COMPLETION, "stream": True}},
        "not json",
    ]
    out = run_batch(tmp_path, lines)
    assert [o["custom_id"] for o in out] == ["c1", "chat", "bad", "emb", "img", "get", "stream", None]
    served = httpx.post(open_gateway.url + "/v1/completions", json=COMPLETION, timeout=60).json()
    assert out[0]["response"]["status_code"] == 200 and out[0]["error"] is None
    assert out[0]["response"]["body"]["choices"][0]["text"] == served["choices"][0]["text"]
    chat = httpx.post(open_gateway.url + "/v1/chat/completions", json=CHAT, timeout=60).json()
    assert out[1]["response"]["body"]["choices"][0]["message"] == chat["choices"][0]["message"]
    assert out[2]["response"]["status_code"] == 400 and out[2]["response"]["body"]["error"]["param"] == "max_tokens"
    assert out[3]["response"]["status_code"] == 400 and "--runner pooling" in out[3]["response"]["body"]["error"]["message"]
    assert [o["error"]["code"] for o in out[4:]] == ["invalid_url", "invalid_request", "invalid_request", "invalid_json"]
    assert all(o["response"] is None for o in out[4:]) and len({o["id"] for o in out}) == len(out)


def test_a_batch_of_embeddings(tmp_path):
    texts = ["Once upon a time", "Lily liked the park"]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "stories260K", "input": t}} for i, t in enumerate(texts)]
    out = run_batch(tmp_path, lines, "--runner", "pooling", "--max-concurrency", "1")
    tok = Tokenizer(BUNDLED_MODEL)
    want = hf_vectors(BUNDLED_MODEL, [tok.encode(t) for t in texts], "LAST")
    for o, w in zip(out, want):
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["data"][0]["embedding"] == pytest.approx(w.tolist(), abs=2e-5)


def test_refusals_before_any_model_loads(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvrelay.cli", "run-batch", "-i", str(tmp_path / "none.jsonl"),
                           "-o", str(tmp_path / "o.jsonl")], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "none.jsonl: no such file" in done.stderr
