"""vLLM's score and rerank APIs, on an embedding model (bi-encoder: the cosine similarity of each
pair's vectors) or on a one-label sequence classifier (cross-encoder: the classifier's sigmoid of
each pair, joined by the tokenizer's pair template, as vLLM scores rerankers).

`POST /score` (`/v1/score`): text_1 against each text_2, or pairwise for two lists of one length.
`POST /rerank` (`/v1/rerank`, `/v2/rerank`): the documents ordered by relevance to the query, as
Jina's and Cohere's rerank endpoints answer. Both run as one pooling request (gateway/embeddings.py),
so they share its quotas, queue and limits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvrelay.engine.pooling.params import PoolingParams
from kvrelay.gateway import errors
from kvrelay.gateway.embeddings import EmbeddingsResponse, pooled_request, prepare_pooled
from kvrelay.gateway.gateway import Gateway, Prepared
from kvrelay.gateway.schemas import RerankRequest, ScoreRequest
from kvrelay.gateway.tenants import Tenant


def _as_list(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else list(texts)


def score_pairs(body: ScoreRequest) -> list[tuple[int, int]]:
    """(index in text_1, index in text_2) of each score asked for."""
    n1, n2 = len(_as_list(body.text_1)), len(_as_list(body.text_2))
    if n1 == 1:
        return [(0, j) for j in range(n2)]
    if n1 != n2:
        raise errors.bad_request(f"text_1 and text_2: {n1} and {n2} texts; give one text_1, or as many as text_2 "
                                 "(scored pairwise)", "text_2")
    return [(i, i) for i in range(n1)]


def _texts(body: ScoreRequest | RerankRequest) -> list[str]:
    if isinstance(body, ScoreRequest):
        return _as_list(body.text_1) + _as_list(body.text_2)
    return [body.query] + [d if isinstance(d, str) else d.text for d in body.documents]


def _pairs(body: ScoreRequest | RerankRequest) -> list[tuple[str, str]]:
    """The (first, second) texts of each score, in the answer's order."""
    if isinstance(body, ScoreRequest):
        t1, t2 = _as_list(body.text_1), _as_list(body.text_2)
        return [(t1[i], t2[j]) for i, j in score_pairs(body)]
    texts = _texts(body)
    return [(texts[0], doc) for doc in texts[1:]]


def _cross_encoder(gw: Gateway) -> bool:
    pooler = getattr(gw.backend, "pooler", None)
    return pooler is not None and pooler.task == "classify"


async def prepare_scoring(gw: Gateway, body: ScoreRequest | RerankRequest, tenant: Tenant) -> Prepared:
    if isinstance(body, ScoreRequest):
        score_pairs(body)  # a bad shape is refused before anything is tokenized
    texts = _texts(body)
    return await prepare_pooled(gw, body, tenant, texts, "documents" if isinstance(body, RerankRequest) else "text_2",
                                len(texts) == 2 and sum(map(len, texts)) <= 256, _prepare,
                                task="classify" if _cross_encoder(gw) else "embed")


def _prepare(gw: Gateway, body: ScoreRequest | RerankRequest, tenant: Tenant) -> Prepared:
    kind, field_name = ("score", "text_2") if isinstance(body, ScoreRequest) else ("rerank", "documents")
    if _cross_encoder(gw):
        labels = gw.backend.pooler.labels
        if len(labels) != 1:
            raise errors.bad_request(f"The model {body.model!r} classifies into {len(labels)} labels; it scores pairs "
                                     "only with one label (a cross-encoder): use /classify", "model",
                                     "model_not_supported")
        for first, second in _pairs(body):
            errors.check_text(first, field_name)
            errors.check_text(second, field_name)
        prompts = [gw.backend.tokenizer.encode_pair(first, second) for first, second in _pairs(body)]
        return pooled_request(gw, body, tenant, prompts, kind, field_name, PoolingParams())
    prompts = [gw._encode(text, field_name) for text in _texts(body)]
    # Cosine similarity is taken on normalized vectors whatever the model's pooler says.
    return pooled_request(gw, body, tenant, prompts, kind, field_name, PoolingParams(normalize=True))


class ScoringResponse(EmbeddingsResponse):
    """Every text's vector, then the scores (score) or the ordered documents (rerank)."""

    def __init__(self, gateway: Gateway, prepared: Prepared, body: ScoreRequest | RerankRequest):
        super().__init__(gateway, prepared)
        self.body = body

    def _scores(self) -> list[float]:
        """One score per pair of _pairs(body): a cross-encoder's probability, or the vectors' cosine."""
        if _cross_encoder(self.gw):
            return [probs[0] for probs in self.all_vectors()]
        vectors = F.normalize(torch.tensor(self.all_vectors()), dim=-1)
        if isinstance(self.body, RerankRequest):
            return (vectors[1:] @ vectors[0]).tolist()
        first = len(_as_list(self.body.text_1))
        return [float(vectors[i] @ vectors[first + j]) for i, j in score_pairs(self.body)]

    def _final_body(self) -> dict:
        p, body = self.p, self.body
        scores = self._scores()
        usage = {"prompt_tokens": self._prompt_tokens, "total_tokens": self._prompt_tokens}
        if isinstance(body, ScoreRequest):
            data = [{"index": k, "object": "score", "score": score} for k, score in enumerate(scores)]
            return {"id": p.request_id, "object": "list", "created": p.created, "model": p.model, "data": data,
                    "usage": usage}
        order = sorted(range(len(scores)), key=lambda k: -scores[k])[: body.top_n or None]
        texts = _texts(body)[1:]
        results = [{"index": k, "relevance_score": scores[k]}
                   | ({"document": {"text": texts[k]}} if body.return_documents else {}) for k in order]
        return {"id": p.request_id, "model": p.model, "usage": usage, "results": results}
