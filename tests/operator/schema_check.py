"""A small validator for the Kubernetes structural-schema subset the InferenceService CRD uses.

Like the API server: unknown fields are errors unless x-kubernetes-preserve-unknown-fields,
defaults are applied. CEL rules (x-kubernetes-validations) are not evaluated here; the operator's
own validation covers them and is tested separately.
"""

from __future__ import annotations

import copy
import re
from typing import Any

TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}


def validate(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    errors: list[str] = []
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            errors.append(f"{path}: must be an integer or a string")
        return errors
    expected = schema.get("type")
    if expected:
        ok = isinstance(value, TYPES[expected]) and not (expected in ("integer", "number") and isinstance(value, bool))
        if not ok:
            return [f"{path}: must be {expected}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema:
            low = schema["minimum"]
            if value < low or (schema.get("exclusiveMinimum") and value == low):
                errors.append(f"{path}: {value} below minimum {low}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} above maximum {schema['maximum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: shorter than {schema['minLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: does not match {schema['pattern']}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}.{key}: required")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            if key in props:
                errors += validate(sub, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                errors += validate(sub, extra, f"{path}.{key}")
            elif not schema.get("x-kubernetes-preserve-unknown-fields") and expected == "object" and (props or extra):
                errors.append(f"{path}.{key}: unknown field")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += validate(item, schema["items"], f"{path}[{i}]")
    return errors


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Fill defaults the way the API server does (recursively, into objects that exist)."""
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(value[key], sub)
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(item, schema["items"]) for item in value]
    return value
