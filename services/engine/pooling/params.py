"""A request's pooling parameters: it asks for an embedding instead of generated tokens."""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.engine.errors import InvalidRequestError


@dataclass
class PoolingParams:
    # Keep the first `dimensions` entries (a Matryoshka model's shorter embedding), before normalizing.
    dimensions: int | None = None
    normalize: bool | None = None  # None: the model's pooler config decides

    def validate(self, hidden_size: int | None = None) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1
                              or hidden_size is not None and d > hidden_size):
            limit = f" and at most the model's {hidden_size}" if hidden_size is not None else ""
            raise InvalidRequestError(f"dimensions: must be an integer >= 1{limit}, got {d!r}", field="dimensions")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize: must be true or false, got {self.normalize!r}", field="normalize")


def check_pooling_request(params, pooler, hidden_size: int) -> None:
    """A pooling engine takes embedding requests only, a generating engine none; `dimensions` only
    where the model is Matryoshka-trained (config.json says so), as vLLM checks."""
    p = params.pooling
    if pooler is None:
        if p is not None:
            raise InvalidRequestError("this model generates text; embeddings need a server started with "
                                      "--runner pooling", field="model")
        return
    if p is None:
        raise InvalidRequestError("this model serves embeddings (--runner pooling): use /v1/embeddings", field="model")
    p.validate(hidden_size)
    if pooler.task == "classify" and (p.dimensions is not None or p.normalize is not None):
        field = "dimensions" if p.dimensions is not None else "normalize"
        raise InvalidRequestError(f"{field}: not for a classification model (it answers label probabilities)",
                                  field=field)
    if params.prompt_logprobs is not None or params.n != 1:
        field = "n" if params.n != 1 else "prompt_logprobs"
        raise InvalidRequestError(f"{field}: not available for embeddings", field=field)
    if p.dimensions is not None and p.dimensions != hidden_size:
        if not pooler.matryoshka:
            raise InvalidRequestError(f"dimensions: this model was not trained for shorter (Matryoshka) embeddings; "
                                      f"it gives {hidden_size}", field="dimensions")
        allowed = pooler.matryoshka_dimensions
        if allowed and p.dimensions not in allowed:
            raise InvalidRequestError(f"dimensions: this model supports {', '.join(map(str, allowed))}, got "
                                      f"{p.dimensions}", field="dimensions")
