"""vLLM's score and rerank APIs on an embedding model: each text's vector from the pooling engine,
and the cosine similarity of the pairs asked for.

`POST /score` (`/v1/score`): text_1 against each text_2, or pairwise for two lists of one length.
`POST /rerank` (`/v1/rerank`, `/v2/rerank`): the documents ordered by similarity to the query, as
Jina's and Cohere's rerank endpoints answer. Both run as one pooling request over every distinct
text (gateway/embeddings.py), so they share its quotas, queue and limits.
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


async def prepare_scoring(gw: Gateway, body: ScoreRequest | RerankRequest, tenant: Tenant) -> Prepared:
    if isinstance(body, ScoreRequest):
        score_pairs(body)  # a bad shape is refused before anything is tokenized
    texts = _texts(body)
    return await prepare_pooled(gw, body, tenant, texts, "documents" if isinstance(body, RerankRequest) else "text_2",
                                len(texts) == 2 and sum(map(len, texts)) <= 256, _prepare)


def _prepare(gw: Gateway, body: ScoreRequest | RerankRequest, tenant: Tenant) -> Prepared:
    if body.user is not None:
        errors.check_text(body.user, "user")
    kind, field_name = ("score", "text_2") if isinstance(body, ScoreRequest) else ("rerank", "documents")
    prompts = [gw._encode(text, field_name) for text in _texts(body)]
    # Cosine similarity is taken on normalized vectors whatever the model's pooler says.
    return pooled_request(gw, body, tenant, prompts, kind, field_name, PoolingParams(normalize=True))


class ScoringResponse(EmbeddingsResponse):
    """Every text's vector, then the scores (score) or the ordered documents (rerank)."""

    def __init__(self, gateway: Gateway, prepared: Prepared, body: ScoreRequest | RerankRequest):
        super().__init__(gateway, prepared)
        self.body = body

    def _final_body(self) -> dict:
        p, body = self.p, self.body
        vectors = F.normalize(torch.tensor(self.all_vectors()), dim=-1)
        usage = {"prompt_tokens": self._prompt_tokens, "total_tokens": self._prompt_tokens}
        if isinstance(body, ScoreRequest):
            first = len(_as_list(body.text_1))
            data = [{"index": k, "object": "score", "score": float(vectors[i] @ vectors[first + j])}
                    for k, (i, j) in enumerate(score_pairs(body))]
            return {"id": p.request_id, "object": "list", "created": p.created, "model": p.model, "data": data,
                    "usage": usage}
        scores = (vectors[1:] @ vectors[0]).tolist()
        order = sorted(range(len(scores)), key=lambda k: -scores[k])[: body.top_n or None]
        texts = _texts(body)[1:]
        results = [{"index": k, "relevance_score": scores[k]}
                   | ({"document": {"text": texts[k]}} if body.return_documents else {}) for k in order]
        return {"id": p.request_id, "model": p.model, "usage": usage, "results": results}
