"""The names a gateway answers to: the model's (the first --served-model-name, or the folder's),
its aliases (the other --served-model-name values, answered as the first, as vLLM does) and its
LoRA adapters' (each a model of its own, kvrelay.engine.lora)."""

from __future__ import annotations

from kvrelay.gateway import errors
from kvrelay.gateway.tenants import Tenant


def served_names(backend) -> list[str]:
    """Every name, in /v1/models' order: the model's, its aliases, its adapters."""
    return [backend.model_name, *backend.model_aliases, *backend.lora_modules]


def may_use(backend, tenant: Tenant, model: str) -> bool:
    """Whether tenant may use model: its allow list names it, or names the model an alias stands for."""
    return tenant.may_use(model) or (model in backend.model_aliases and tenant.may_use(backend.model_name))


def check_model(backend, model: str, tenant: Tenant) -> None:
    """404 naming the models served, or 403 for one the tenant may not use."""
    names = served_names(backend)
    if model not in names:
        raise errors.model_not_found(model, names)
    if not may_use(backend, tenant, model):
        raise errors.forbidden(f"Tenant {tenant.id!r} may not use model {model!r}", "model")


SERVES = {"generate": "generates text (completions, chat, responses)",
          "embed": "is an embedding model (/v1/embeddings, /score, /rerank)",
          "classify": "is a classification model (/classify; with one label also /score and /rerank)"}


def check_runner(backend, model: str, wanted: str) -> None:
    """400 when the model serves another kind of request (wanted: generate, embed or classify): a
    pooling engine (kvrelay.engine.pooling) embeds or classifies only, a generating one neither."""
    pooler = getattr(backend, "pooler", None)  # workers behind a cluster gateway generate
    task = "generate" if pooler is None else pooler.task
    if task == wanted:
        return
    fix = ("start `kvrelay serve` with an embedding or classification model (--runner pooling)"
           if task == "generate" else "use the endpoints it serves")
    raise errors.bad_request(f"The model {model!r} {SERVES[task]}: {fix}", "model", "model_not_supported")


def answered_as(backend, model: str) -> str:
    """The name answers and metrics carry: the model's own for an alias."""
    return backend.model_name if model in backend.model_aliases else model
