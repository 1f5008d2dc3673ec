"""/v1/embeddings through the official openai client: a pooling engine's vectors equal transformers'
pooled last hidden state, in both encodings, with Matryoshka dimensions, quotas and clear errors;
in process, and through `kvrelay serve`'s engine-core process."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from gateway_helpers import InProcessGateway, write_tenants
from kvrelay.gateway.tenants import hash_key

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from embedding_models import hf_vectors, save_bare_decoder, write_sentence_transformers
from helpers import PROMPTS, serve
from kvrelay.engine.tokenizer import Tokenizer

from kvrelay.models import BUNDLED_MODEL


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = save_bare_decoder(tmp_path_factory.mktemp("emb") / "tiny-embed", "qwen3", matryoshka_dimensions=[16, 64])
    write_sentence_transformers(path, "LAST", normalize=True)
    return path


@pytest.fixture(scope="module")
def gateway(model_dir, tmp_path_factory):
    tenants = write_tenants(tmp_path_factory.mktemp("tenants") / "tenants.yaml", [
        {"id": "big", "api_keys_sha256": [hash_key("sk-big")]},
        {"id": "small", "api_keys_sha256": [hash_key("sk-small")], "quotas": {"tokens_per_minute": 40}},
    ])
    gw = InProcessGateway(tenants_file=tenants, engine_kwargs={"model": str(model_dir), "max_model_len": 64,
                                                               "max_num_batched_tokens": 16})
    yield gw
    gw.stop()


def _client(url: str, key: str = "sk-big") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def _ids(prompts: list[str]) -> list[list[int]]:
    tok = Tokenizer(BUNDLED_MODEL)
    return [tok.encode(p) for p in prompts]


def _assert_vectors(got: list[list[float]], want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, dtype=np.float32), w.numpy(), atol=2e-5, rtol=1e-4)


def test_vectors_equal_transformers_in_both_encodings(gateway, model_dir):
    client = _client(gateway.url)
    want = hf_vectors(model_dir, _ids(PROMPTS), "LAST")
    b64 = client.embeddings.create(model="tiny-embed", input=PROMPTS)  # the client asks for base64
    _assert_vectors([d.embedding for d in b64.data], want)
    assert [d.index for d in b64.data] == list(range(len(PROMPTS)))
    assert b64.model == "tiny-embed" and b64.object == "list"
    assert b64.usage.prompt_tokens == b64.usage.total_tokens == sum(map(len, _ids(PROMPTS)))
    floats = client.embeddings.create(model="tiny-embed", input=PROMPTS[0], encoding_format="float")
    _assert_vectors([floats.data[0].embedding], want[:1])
    raw = httpx.post(gateway.url + "/v1/embeddings", headers={"Authorization": "Bearer sk-big"},
                     json={"model": "tiny-embed", "input": PROMPTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.asarray(floats.data[0].embedding, dtype=np.float32))


def test_token_id_inputs_dimensions_and_normalize(gateway, model_dir):
    client = _client(gateway.url)
    ids = _ids(PROMPTS[:3])
    one = client.embeddings.create(model="tiny-embed", input=ids[0], encoding_format="float")
    many = client.embeddings.create(model="tiny-embed", input=ids, encoding_format="float")
    _assert_vectors([one.data[0].embedding], hf_vectors(model_dir, ids[:1], "LAST"))
    _assert_vectors([d.embedding for d in many.data], hf_vectors(model_dir, ids, "LAST"))
    short = client.embeddings.create(model="tiny-embed", input=PROMPTS[:3], dimensions=16, encoding_format="float")
    assert {len(d.embedding) for d in short.data} == {16}
    _assert_vectors([d.embedding for d in short.data], hf_vectors(model_dir, ids, "LAST", dimensions=16))
    raw = client.embeddings.create(model="tiny-embed", input=PROMPTS[:3], encoding_format="float",
                                   extra_body={"normalize": False})
    _assert_vectors([d.embedding for d in raw.data], hf_vectors(model_dir, ids, "LAST", normalize=False))


def test_errors_are_specific(gateway):
    client = _client(gateway.url)
    with pytest.raises(openai.BadRequestError, match="is an embedding model") as e:
        client.completions.create(model="tiny-embed", prompt="Hi", max_tokens=2)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="supports 16, 64, got 8"):
        client.embeddings.create(model="tiny-embed", input="Hi", dimensions=8)
    long = "one two three four five six seven eight nine ten " * 10
    with pytest.raises(openai.BadRequestError, match="maximum context length is 64 tokens; input 1 has") as e:
        client.embeddings.create(model="tiny-embed", input=["Hi", long])
    assert e.value.code == "context_length_exceeded"
    cut = client.embeddings.create(model="tiny-embed", input=long, extra_body={"truncate_prompt_tokens": 64})
    assert cut.usage.prompt_tokens == 64
    with pytest.raises(openai.BadRequestError, match="input"):
        client.embeddings.create(model="tiny-embed", input="")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="Hi")
    assert gateway.engine.engine.pool.num_free == gateway.engine.engine.pool.num_blocks  # nothing stranded


def test_embeddings_count_against_the_token_quota(gateway):
    small = _client(gateway.url, "sk-small")
    first = small.embeddings.create(model="tiny-embed", input=PROMPTS[2])  # 20+ tokens of 40
    assert first.usage.prompt_tokens > 20
    with pytest.raises(openai.RateLimitError, match="tokens_per_minute"):
        small.embeddings.create(model="tiny-embed", input=PROMPTS[2])


def test_a_generating_server_refuses_embeddings(open_gateway):
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        _client(open_gateway.url).embeddings.create(model="stories260K", input="Hi")


def test_serve_runner_pooling_through_the_engine_core_process(model_dir, tmp_path):
    """`kvrelay serve --runner pooling` on a generative checkpoint (the bundled model, MEAN pooling)."""
    with serve(tmp_path / "serve.log", "--model", str(BUNDLED_MODEL), "--runner", "pooling",
               "--pooler-config", '{"pooling_type": "MEAN"}') as url:
        out = _client(url).embeddings.create(model="stories260K", input=PROMPTS[:2])
        _assert_vectors([d.embedding for d in out.data], hf_vectors(BUNDLED_MODEL, _ids(PROMPTS[:2]), "MEAN"))
        with pytest.raises(openai.BadRequestError, match="is an embedding model"):
            _client(url).chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize("argv", [["serve", "--disaggregated"], ["decode", "--port", "0"]])
def test_no_prefill_decode_split_for_embeddings(argv):
    run = subprocess.run([sys.executable, "-m", "kvrelay.cli", *argv, "--runner", "pooling"], check=False,
                         capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0
    assert "no decode phase to hand" in run.stderr, run.stderr[-2000:]


def _post(url: str, path: str, body: dict, key: str = "sk-big") -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _cosines(model_dir, query: str, docs: list[str]) -> list[float]:
    vectors = hf_vectors(model_dir, _ids([query, *docs]), "LAST")
    return [float(vectors[0] @ v) for v in vectors[1:]]


def test_score_one_against_many_and_pairwise(gateway, model_dir):
    docs = PROMPTS[1:4]
    one = _post(gateway.url, "/v1/score", {"model": "tiny-embed", "text_1": PROMPTS[0], "text_2": docs})
    assert one.status_code == 200, one.text
    body = one.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["data"][0]["object"] == "score"
    assert [d["score"] for d in body["data"]] == pytest.approx(_cosines(model_dir, PROMPTS[0], docs), abs=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(map(len, _ids([PROMPTS[0], *docs])))
    pairs = _post(gateway.url, "/score", {"model": "tiny-embed", "text_1": PROMPTS[:2], "text_2": PROMPTS[2:4]}).json()
    want = [_cosines(model_dir, PROMPTS[i], [PROMPTS[i + 2]])[0] for i in range(2)]
    assert [d["score"] for d in pairs["data"]] == pytest.approx(want, abs=1e-5)
    bad = _post(gateway.url, "/v1/score", {"model": "tiny-embed", "text_1": PROMPTS[:2], "text_2": PROMPTS[2:5]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
    assert "give one text_1, or as many as text_2" in bad.json()["error"]["message"]


def test_rerank_orders_documents_by_similarity(gateway, model_dir):
    query, docs = PROMPTS[0], PROMPTS[1:6]
    cos = _cosines(model_dir, query, docs)
    out = _post(gateway.url, "/v1/rerank", {"model": "tiny-embed", "query": query, "documents": docs, "top_n": 3})
    assert out.status_code == 200, out.text
    results = out.json()["results"]
    best = sorted(range(len(docs)), key=lambda k: -cos[k])[:3]
    assert [r["index"] for r in results] == best
    assert [r["relevance_score"] for r in results] == pytest.approx([cos[k] for k in best], abs=1e-5)
    assert [r["document"]["text"] for r in results] == [docs[k] for k in best]
    plain = _post(gateway.url, "/v2/rerank", {"model": "tiny-embed", "query": query, "return_documents": False,
                                               "documents": [{"text": d} for d in docs]}).json()
    assert len(plain["results"]) == len(docs) and "document" not in plain["results"][0]
    assert plain["usage"]["total_tokens"] == sum(map(len, _ids([query, *docs])))


def test_score_and_rerank_need_an_embedding_model(open_gateway):
    for path, body in (("/v1/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]})):
        out = _post(open_gateway.url, path, {"model": "stories260K", **body})
        assert out.status_code == 400 and "--runner pooling" in out.json()["error"]["message"]
