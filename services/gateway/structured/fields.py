"""Request fields that constrain the output, as OpenAI and vLLM name them, and their translation
into the engine's GuidedSpec.

- `response_format`: `{"type": "text" | "json_object"}` or `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}` (OpenAI);
- `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM's extra parameters);
- `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}` (vLLM's newer object).

At most one of them may constrain a request. Each is compiled (cached) while the request is
prepared, so a grammar the library rejects is a 400 naming the field that carried it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.structured.compiler import compiler_for
from kvrelay.engine.structured.spec import GuidedSpec
from kvrelay.gateway import errors
from pydantic import BaseModel, ConfigDict, Field

_NAME = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JsonSchemaFormat(_Strict):
    name: _NAME
    description: str | None = None
    # `schema` shadows a BaseModel attribute: kept under another name, with the wire name as alias.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class StructuredFields(_Strict):
    """Mixed into the completion and chat request bodies."""

    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


def _json_text(value: str | dict) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def requested_spec(body: StructuredFields) -> GuidedSpec | None:
    """The one constraint the body asks for, or None; 400 when it asks for two."""
    found: list[GuidedSpec] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(GuidedSpec("json_object", "", "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise errors.bad_request("response_format: type json_schema needs json_schema.schema",
                                     "response_format")
        found.append(GuidedSpec("json", json.dumps(rf.json_schema.schema_), "response_format"))
    if body.guided_json is not None:
        found.append(GuidedSpec("json", _json_text(body.guided_json), "guided_json"))
    if body.guided_regex is not None:
        found.append(GuidedSpec("regex", body.guided_regex, "guided_regex"))
    if body.guided_choice is not None:
        found.append(GuidedSpec("choice", json.dumps(body.guided_choice), "guided_choice"))
    if body.guided_grammar is not None:
        found.append(GuidedSpec("grammar", body.guided_grammar, "guided_grammar"))
    so = body.structured_outputs
    if so is not None:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(so, k) is not None]
        given += ["json_object"] if so.json_object else []
        if len(given) != 1:
            raise errors.bad_request("structured_outputs: give exactly one of json, regex, choice, grammar, "
                                     "json_object", "structured_outputs")
        kind = given[0].rstrip("_")
        value = getattr(so, given[0])
        text = {"json": lambda: _json_text(value), "choice": lambda: json.dumps(value),
                "json_object": lambda: ""}.get(kind, lambda: value)()
        found.append(GuidedSpec(kind, text, "structured_outputs"))
    if len(found) > 1:
        raise errors.bad_request(f"{found[1].field}: only one output constraint per request; this one also has "
                                 f"{found[0].field}", found[1].field)
    return found[0] if found else None


def checked(spec: GuidedSpec | None, tokenizer) -> GuidedSpec | None:
    """Compile spec (cached) to check it: a grammar the library rejects is a 400 naming its field."""
    if spec is not None:
        try:
            compiler_for(tokenizer).get(spec)
        except InvalidRequestError as e:
            raise errors.bad_request(str(e), e.field) from e
    return spec
