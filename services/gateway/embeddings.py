"""Embeddings through the gateway: validate and tokenize an embeddings request, then answer it in
OpenAI's shape once the pooling engine (kvrelay.engine.pooling) has pooled every input.

The request takes the path a completion takes (tenant, model, request rate, tokenizing off the
event loop, quota, fair queue, deadline, abort on disconnect): only the answer differs, so
EmbeddingsResponse is a GenerationResponse that keeps each input's vector instead of text.
"""

from __future__ import annotations

import base64
import uuid

import numpy as np
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.pooling.params import PoolingParams
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.gateway import errors, model_names
from kvrelay.gateway.errors import ApiError
from kvrelay.gateway.gateway import INLINE_PROMPT_CHARS, Gateway, Prepared, _request_priority
from kvrelay.gateway.response import GenerationResponse, _Choice
from kvrelay.gateway.schemas import EmbeddingRequest
from kvrelay.gateway.tenants import Tenant


async def prepare_embedding(gw: Gateway, body: EmbeddingRequest, tenant: Tenant) -> Prepared:
    return await prepare_inputs(gw, body, tenant, _prepare, "embed")


async def prepare_inputs(gw: Gateway, body, tenant: Tenant, prepare, task: str) -> Prepared:
    """prepare_pooled for a body whose `input` is OpenAI's prompt forms (embeddings, classify)."""
    raw = body.input
    texts = [raw] if isinstance(raw, str) else [x for x in raw if isinstance(x, str)]
    inline = isinstance(raw, str) and len(raw) <= INLINE_PROMPT_CHARS
    return await prepare_pooled(gw, body, tenant, texts, "input", inline, prepare, task)


async def prepare_pooled(gw: Gateway, body, tenant: Tenant, texts: list[str], field_name: str, inline: bool,
                         prepare, task: str = "embed") -> Prepared:
    """The checks every pooling request passes before its texts are tokenized (by prepare(gw, body,
    tenant), off the event loop unless inline): model, task (embed or classify), size, request rate."""
    gw.check_model(body.model, tenant)
    model_names.check_runner(gw.backend, body.model, task)
    gw._check_prompt_bytes(texts, field_name)
    await gw.check_request_rate(tenant)
    return await gw._offload(prepare, gw, body, tenant, inline=inline)


def _prepare(gw: Gateway, body: EmbeddingRequest, tenant: Tenant) -> Prepared:
    prompts = gw.encode_prompts(body.input, "input")
    return pooled_request(gw, body, tenant, prompts, "embedding", "input", PoolingParams(body.dimensions, body.normalize))


def pooled_request(gw: Gateway, body, tenant: Tenant, prompts: list[list[int]], kind: str, field_name: str,
                   pooling: PoolingParams) -> Prepared:
    """A Prepared request that pools each prompt (truncated by the body's truncate_prompt_tokens),
    each checked against the vocabulary and the context."""
    if body.user is not None:
        errors.check_text(body.user, "user")
    prompts = gw._truncate(prompts, body)
    vocab = gw.backend.tokenizer.vocab_size
    if any(t >= vocab for p in prompts for t in p):
        raise errors.bad_request(f"{field_name}: token ids must be < the vocabulary size {vocab}", field_name)
    limit = gw.backend.max_model_len
    for i, ids in enumerate(prompts):
        if not ids:
            raise errors.bad_request(f"{field_name}: input {i} has no tokens", field_name)
        if len(ids) > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens; input {i} has {len(ids)}: "
                           "shorten it, or set truncate_prompt_tokens", param=field_name,
                           code="context_length_exceeded")
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling,
                            lora=body.model if body.model in gw.backend.lora_modules else None)
    try:
        params.validate(vocab)
    except InvalidRequestError as e:
        raise errors.bad_request(str(e), e.field) from e
    prefix = {"embedding": "embd", "score": "score", "rerank": "rerank", "classify": "classify"}[kind]
    p = Prepared(kind, f"{prefix}-{uuid.uuid4().hex}", model_names.answered_as(gw.backend, body.model), tenant,
                 prompts, params, stream=False, include_usage=False, logprobs=False,
                 reserve=sum(len(ids) for ids in prompts))
    p.cache_salt = gw.cache_salt(tenant, None)  # LAST pooling reuses cached prefixes: tenants' stay apart
    p.priority = _request_priority(body, tenant)
    return p


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: a list of floats, or base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class EmbeddingsResponse(GenerationResponse):
    """A GenerationResponse whose answer is every input's vector (never streamed)."""

    def __init__(self, gateway: Gateway, prepared: Prepared, encoding_format: str = "float"):
        super().__init__(gateway, prepared)
        self.encoding_format = encoding_format
        self.vectors: dict[int, list[float]] = {}

    def _absorb(self, i: int, out) -> tuple[int, _Choice, dict | None]:
        c = self.choices.setdefault(i, _Choice())
        c.finish_reason = out.finish_reason or c.finish_reason
        if out.embedding is not None:
            self.vectors[i] = out.embedding
        if out.num_cached_tokens:
            self.cached[i] = out.num_cached_tokens
        return i, c, None

    def all_vectors(self) -> list[list[float]]:
        """Every input's vector, in order; 503 when one ended without (aborted upstream)."""
        missing = set(range(len(self.p.prompts))) - set(self.vectors)
        if missing:
            raise errors.unavailable(f"The engine ended input {min(missing)} without an embedding", "engine_aborted")
        return [self.vectors[i] for i in range(len(self.p.prompts))]

    def _final_body(self) -> dict:
        p = self.p
        data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, self.encoding_format)}
                for i, v in enumerate(self.all_vectors())]
        tokens = self._prompt_tokens
        return {"id": p.request_id, "object": "list", "created": p.created, "model": p.model, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
