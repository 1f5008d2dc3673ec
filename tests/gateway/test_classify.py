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
    for path, body in (("/v1/embeddings", {"input": "Hi"}), ("/v1/completions", {"prompt": "Hi"})):
        out = httpx.post(gw.url + path, json={"model": "tiny-cls", **body}, timeout=60)
        assert out.status_code == 400 and "is a classification model (/classify" in out.json()["error"]["message"]
    out = httpx.post(open_gateway.url + "/classify", json={"model": "stories260K", "input": "Hi"}, timeout=60)
    assert out.status_code == 400 and "generates text" in out.json()["error"]["message"]
    bad = httpx.post(gw.url + "/classify", json={"model": "tiny-cls", "input": []}, timeout=60)
    assert bad.status_code == 400


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = save_classifier(tmp_path_factory.mktemp("rr") / "tiny-rerank", "llama", 1)
    gw = InProcessGateway(engine_kwargs={"model": str(path), "max_num_batched_tokens": 16})
    yield gw, path
    gw.stop()


def _hf_pair_scores(path, pairs: list[tuple[str, str]]) -> list[float]:
    """transformers' cross-encoder: the tokenizer's pair encoding, the one logit's sigmoid."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    ids = [tok(a, b)["input_ids"] for a, b in pairs]
    return [float(p[0]) for p in hf_class_probs(path, ids)]


def test_a_one_label_classifier_scores_and_reranks_pairs(reranker):
    gw, path = reranker
    query, docs = PROMPTS[0], PROMPTS[1:5]
    want = _hf_pair_scores(path, [(query, d) for d in docs])
    score = httpx.post(gw.url + "/v1/score", json={"model": "tiny-rerank", "text_1": query, "text_2": docs},
                       timeout=60).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=1e-5)
    pairwise = httpx.post(gw.url + "/score", json={"model": "tiny-rerank", "text_1": docs[:2], "text_2": docs[2:]},
                          timeout=60).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        _hf_pair_scores(path, [(docs[0], docs[2]), (docs[1], docs[3])]), abs=1e-5)
    ranked = httpx.post(gw.url + "/rerank", json={"model": "tiny-rerank", "query": query, "documents": docs,
                                                  "top_n": 2}, timeout=60).json()["results"]
    best = sorted(range(len(docs)), key=lambda k: -want[k])[:2]
    assert [r["index"] for r in ranked] == best
    assert [r["relevance_score"] for r in ranked] == pytest.approx([want[k] for k in best], abs=1e-5)


def test_a_many_label_classifier_does_not_score_pairs(classifier):
    gw, _ = classifier
    out = httpx.post(gw.url + "/v1/score", json={"model": "tiny-cls", "text_1": "a", "text_2": "b"}, timeout=60)
    assert out.status_code == 400 and "classifies into 3 labels" in out.json()["error"]["message"]
