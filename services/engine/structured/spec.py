"""What a request constrains its output to: one grammar of one kind, and the field that asked for it.

Kept free of the grammar library so SamplingParams, the wire conversion and the gateway can
carry it without importing llguidance.
"""

from __future__ import annotations

from dataclasses import dataclass

# kind -> what `value` holds
KINDS = {
    "json": "a JSON schema, as JSON text",
    "json_object": "nothing: any JSON object",
    "regex": "a regular expression the whole output matches",
    "choice": "a JSON list of strings: the output is exactly one of them",
    "grammar": "a grammar: Lark (llguidance's syntax) or GBNF/EBNF with `::=` rules",
}
MAX_SPEC_BYTES = 256 * 1024  # a schema or grammar larger than this is refused (compile time grows with it)


@dataclass(frozen=True)
class GuidedSpec:
    kind: str
    value: str
    # The request field that carried it (response_format, guided_json, ...): named in a 400.
    field: str = "structured_outputs"
    # A reasoning model's think block (start id, end id), which the grammar lets through first (as
    # vLLM does with a reasoning parser): the grammar applies after the end token, and the first
    # token may open the block. thinking: the prompt opened it, so the output starts inside it.
    think_tokens: tuple[int, int] | None = None
    thinking: bool = False

    def key(self) -> tuple[str, str]:
        """The compile cache key: the field does not change the grammar."""
        return self.kind, self.value
