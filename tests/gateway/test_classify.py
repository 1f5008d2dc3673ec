"""/classify on a sequence classifier (vLLM's classification API): label probabilities equal to
transformers', the likeliest label by name, and the other endpoints refused by name."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from gateway_helpers import InProcessGateway

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from embedding_models import hf_class_probs, save_classifier
from helpers import PROMPTS
from kvrelay.engine.tokenizer import Tokenizer

from kvrelay.models import BUNDLED_MODEL

LABELS = {"0": "negative", "1": "neutral", "2": "positive"}


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = save_classifier(tmp_path_factory.mktemp("cls") / "tiny-cls", "qwen3", 3, id2label=LABELS)
    gw = InProcessGateway(engine_kwargs={"model": str(path), "max_num_batched_tokens": 16})
    yield gw, path
    gw.stop()


def test_classify_answers_label_probabilities(classifier):
    gw, path = classifier
    out = httpx.post(gw.url + "/classify", json={"model": "tiny-cls", "input": PROMPTS[:4]}, timeout=60)
    assert out.status_code == 200, out.text
    body = out.json()
    tok = Tokenizer(BUNDLED_MODEL)
    ids = [tok.encode(p) for p in PROMPTS[:4]]
    want = hf_class_probs(path, ids)
    assert body["object"] == "list" and body["model"] == "tiny-cls" and body["id"].startswith("classify-")
    for item, probs in zip(body["data"], want):
        assert item["probs"] == pytest.approx(probs.tolist(), abs=1e-5)
        assert item["num_classes"] == 3 and item["label"] == LABELS[str(int(probs.argmax()))]
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    one = httpx.post(gw.url + "/v1/classify", json={"model": "tiny-cls", "input": ids[0]}, timeout=60).json()
    assert one["data"][0]["probs"] == pytest.approx(want[0].tolist(), abs=1e-5)


def test_a_classifier_refuses_other_endpoints_by_name(classifier, open_gateway):
    gw, _ = classifier
    for path, body in (("/v1/embeddings", {"input": "Hi"}), ("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        out = httpx.post(gw.url + path, json={"model": "tiny-cls", **body}, timeout=60)
        assert out.status_code == 400 and "is a classification model (/classify)" in out.json()["error"]["message"]
    out = httpx.post(open_gateway.url + "/classify", json={"model": "stories260K", "input": "Hi"}, timeout=60)
    assert out.status_code == 400 and "generates text" in out.json()["error"]["message"]
    bad = httpx.post(gw.url + "/classify", json={"model": "tiny-cls", "input": []}, timeout=60)
    assert bad.status_code == 400
