"""Errors the engine raises. Each names what was wrong and what was expected."""

from __future__ import annotations


class EngineError(Exception):
    """Base class for every error kvrelay's engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request parameter is invalid. `field` names it (for HTTP 400 bodies)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # pickled across the engine-core process boundary with its field
        return type(self), (str(self), self.field)


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) does not fit the model's context or the configured limit."""

    def __init__(self, message: str, num_tokens: int, limit: int, field: str = "prompt"):
        super().__init__(message, field)
        self.num_tokens = num_tokens
        self.limit = limit

    def __reduce__(self):
        return type(self), (str(self), self.num_tokens, self.limit, self.field)


class ModelLoadError(EngineError):
    """A model folder cannot be loaded: names the file, tensor and what was expected."""


class EngineDeadError(EngineError):
    """The engine's step loop crashed; no further requests can be served."""
