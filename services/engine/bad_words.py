"""vLLM's `bad_words`: words the output may not contain. Each word is banned as its tokenizer spells
it alone and after a space (both forms occur in text); the last token of a form is banned whenever
the output so far ends with the form's other tokens (a one-token form: always).

It runs as a logits processor of the sequence (kvrelay.engine.logits_processors' contract), so it
reads the output on the host like the plugins do: such sequences do not speculate, and under async
scheduling they sample once their previous token is known.
"""

from __future__ import annotations

import torch

MAX_WORDS = 100
MAX_WORD_CHARS = 100


def word_forms(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token ids alone and after a space, distinct and non-empty."""
    forms: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode_plain(text, add_special_tokens=False)
            if ids and ids not in forms:
                forms.append(ids)
    return forms


class BadWords:
    """One sequence's ban: call with its output ids and its fp32 logits row (edited in place)."""

    def __init__(self, forms: list[list[int]]):
        self.forms = forms

    def __call__(self, output_ids: list[int], row: torch.Tensor) -> None:
        for form in self.forms:
            head = len(form) - 1
            if head == 0 or (len(output_ids) >= head and output_ids[-head:] == form[:-1]):
                row[form[-1]] = float("-inf")
