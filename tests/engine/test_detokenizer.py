"""Incremental detokenization never splits a UTF-8 character; deltas add up to the full decode."""

from __future__ import annotations

import pytest
from kvrelay.engine.detokenizer import IncrementalDetokenizer
from kvrelay.engine.tokenizer import Tokenizer

from kvrelay.models import BUNDLED_MODEL

TEXTS = [
    "The café served crème brûlée 😀 to everyone.",
    "Emoji 👩‍👩‍👧 family, flags 🇫🇷 and CJK 你好世界.",
    "Ünïcödé àccents — dashes… and ½ fractions",
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(BUNDLED_MODEL)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_equal_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Hello")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(3 <= i <= 258 for i in ids), "the text must use byte-fallback tokens"
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=[])
    deltas = []
    for i in ids:
        detok.add_token(i)
        deltas.append(detok.take())
    deltas.append(detok.take(final=True))
    for d in deltas:
        assert "\ufffd" not in d
    assert "".join(deltas) == tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)) :]


def test_stop_string_inside_multibyte_text(tokenizer):
    ids = tokenizer.encode("I like crème brûlée a lot", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"), stop=["brû"])
    out, hit = "", None
    for i in ids:
        hit = detok.add_token(i)
        out += detok.take(final=hit is not None)
        if hit:
            break
    assert hit == "brû" and out == " I like crème "
