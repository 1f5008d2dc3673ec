"""POST /tokenize and /detokenize, as vLLM serves them: the model's own token ids for a prompt (or for
chat messages through the chat template), and the text of token ids. Evaluation harnesses and
clients that budget context use them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from kvrelay.gateway import chat_render, errors
from kvrelay.gateway.chat_render import ChatTemplateFields
from kvrelay.gateway.deps import gateway_of, tenant_of
from kvrelay.gateway.schemas import ERROR_RESPONSES, ChatMessage, TokenIds, _Strict
from kvrelay.gateway.tenants import Tenant
from pydantic import Field

router = APIRouter()
RESPONSES = {k: ERROR_RESPONSES[k] for k in (400, 401, 403, 404, 413)}


class TokenizeRequest(ChatTemplateFields):  # messages render as chat requests render them (chat_render.py)
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True  # prompts: BOS as the tokenizer adds it
    return_token_strs: bool = False


class TokenizeResponse(_Strict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(_Strict):
    prompt: str


def _check_model(request: Request, model: str | None, tenant: Tenant) -> None:
    if model is not None:
        gateway_of(request).check_model(model, tenant)


@router.post("/tokenize", response_model=TokenizeResponse, responses=RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request, tenant: Annotated[Tenant, Depends(tenant_of)]):
    gateway = gateway_of(request)
    _check_model(request, body.model, tenant)
    if (body.prompt is None) == (body.messages is None):
        raise errors.bad_request("prompt: give exactly one of `prompt` and `messages`", "prompt")
    tok = gateway.backend.tokenizer

    def run() -> list[int]:
        if body.prompt is not None:
            gateway._check_prompt_bytes([body.prompt], "prompt")
            if body.add_special_tokens:  # the ids a completion of this prompt runs on
                return gateway._encode(body.prompt, "prompt")
            return tok.encode_plain(body.prompt, add_special_tokens=False)
        images = getattr(gateway.backend, "images", None)  # a vision model counts each image's placeholders
        messages = chat_render.template_messages(body.messages, images=images is not None)
        gateway._check_prompt_bytes(chat_render.message_texts(body.messages), "messages")
        ids = chat_render.render(tok, messages, body, {}, gateway.config.allow_special_tokens)
        return images.expand(ids) if images is not None else ids

    ids = await gateway._offload(run)
    out = {"count": len(ids), "max_model_len": gateway.backend.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [tok.id_to_token(t) or "" for t in ids]
    return out


@router.post("/detokenize", response_model=DetokenizeResponse, responses=RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request, tenant: Annotated[Tenant, Depends(tenant_of)]):
    gateway = gateway_of(request)
    _check_model(request, body.model, tenant)
    tok = gateway.backend.tokenizer
    if any(t >= tok.vocab_size for t in body.tokens):
        raise errors.bad_request(f"tokens: token ids must be < the vocabulary size {tok.vocab_size}", "tokens")
    return {"prompt": tok.decode(list(body.tokens))}
