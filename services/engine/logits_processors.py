"""Per-request logits processors from plugins (entry-point group kvrelay.logits_processors).

A request names them in its extra body, `"logits_processors": ["name"]` or
`{"name": {...args}}`. The contract of a processor class:
- `validate(args: dict) -> None` (optional, a classmethod or staticmethod): raise ValueError
  with a message for bad arguments; the request gets a 400 naming `logits_processors`;
- `cls(args)`: one instance per sequence (it may keep state across that sequence's steps);
- `instance(output_ids: list[int], logits: Tensor) -> Tensor | None`: logits is the sequence's
  fp32 row [vocab] before temperature and filtering; edit it in place (return None) or return a
  row of the same shape.

Cost is bounded: at most MAX_PER_REQUEST processors per request, arguments of at most
MAX_ARGS_BYTES as JSON, and each call sees one row (it runs once per sampled token).
"""

from __future__ import annotations

import json

import torch
from kvrelay.engine.errors import InvalidRequestError

GROUP = "kvrelay.logits_processors"
MAX_PER_REQUEST = 4
MAX_ARGS_BYTES = 4096


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"logits_processors: {message}", field="logits_processors")


def normalise(spec) -> dict[str, dict] | None:
    """["a", "b"] or {"a": {...}} -> {"a": {...}, "b": {}}; None stays None."""
    if spec is None:
        return None
    if isinstance(spec, list) and all(isinstance(n, str) for n in spec):
        return {n: {} for n in spec}
    if isinstance(spec, dict) and all(isinstance(n, str) and isinstance(a, dict) for n, a in spec.items()):
        return dict(spec)
    raise _bad("must be a list of processor names or an object of name -> arguments object")


def validate(spec: dict[str, dict] | None) -> None:
    """Raise InvalidRequestError (field logits_processors) unless every named processor is loaded
    here and accepts its arguments."""
    if not spec:
        return
    from kvrelay.plugins import loaded

    available = loaded(GROUP)
    if len(spec) > MAX_PER_REQUEST:
        raise _bad(f"at most {MAX_PER_REQUEST} per request, got {len(spec)}")
    for name, args in spec.items():
        if name not in available:
            raise _bad(f"{name!r} is not loaded here; loaded: {sorted(available) or 'none'}")
        try:
            size = len(json.dumps(args))
        except (TypeError, ValueError) as exc:
            raise _bad(f"arguments of {name!r} must be JSON: {exc}") from exc
        if size > MAX_ARGS_BYTES:
            raise _bad(f"arguments of {name!r} are {size} bytes as JSON, at most {MAX_ARGS_BYTES}")
        check = getattr(available[name].value, "validate", None)
        if check is not None:
            try:
                check(args)
            except ValueError as exc:
                raise _bad(f"{name}: {exc}") from exc


def instantiate(spec: dict[str, dict] | None) -> list:
    """One processor instance per named processor (call per sequence, after validate)."""
    if not spec:
        return []
    from kvrelay.plugins import loaded

    available = loaded(GROUP)
    return [available[name].value(args) for name, args in spec.items()]


def apply(processors: list, output_ids: list[int], row: torch.Tensor) -> None:
    """Run a sequence's processors on its logits row, in place."""
    for proc in processors:
        out = proc(output_ids, row)
        if out is not None and out is not row:
            row.copy_(out)
