"""vLLM's classification API on a sequence classifier (kvrelay.engine.architectures.classify):
each input's label probabilities and the likeliest label, as one pooling request."""

from __future__ import annotations

from kvrelay.engine.pooling.params import PoolingParams
from kvrelay.gateway.embeddings import EmbeddingsResponse, pooled_request, prepare_inputs
from kvrelay.gateway.gateway import Gateway, Prepared
from kvrelay.gateway.schemas import ClassifyRequest
from kvrelay.gateway.tenants import Tenant


async def prepare_classify(gw: Gateway, body: ClassifyRequest, tenant: Tenant) -> Prepared:
    return await prepare_inputs(gw, body, tenant, _prepare, "classify")


def _prepare(gw: Gateway, body: ClassifyRequest, tenant: Tenant) -> Prepared:
    return pooled_request(gw, body, tenant, gw.encode_prompts(body.input, "input"), "classify", "input",
                          PoolingParams())


class ClassifyResponse(EmbeddingsResponse):
    def _final_body(self) -> dict:
        p, names = self.p, self.gw.backend.pooler.labels
        data = []
        for i, probs in enumerate(self.all_vectors()):
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": names[best], "probs": probs, "num_classes": len(probs)})
        tokens = self._prompt_tokens
        return {"id": p.request_id, "object": "list", "created": p.created, "model": p.model, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}
