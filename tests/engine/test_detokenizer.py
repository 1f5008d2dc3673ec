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


@pytest.mark.parametrize("keep", [False, True])
def test_stop_string_inside_multibyte_text(tokenizer, keep):
    """The earliest stop string ends the text, itself included with keep_stop
    (include_stop_str_in_output), and nothing after it."""
    ids = tokenizer.encode("I like crème brûlée a lot, really", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"), stop=["a lot", "brû"], keep_stop=keep)
    out, hit = "", None
    for i in ids:
        hit = detok.add_token(i)
        out += detok.take(final=hit is not None)
        if hit:
            break
    assert hit == "brû"
    assert out == (" I like crème brû" if keep else " I like crème ")


def _stream(tokenizer, prompt, ids, stop=(), slow=False):
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=list(stop))
    if slow:  # the full-decode path for every token
        detok._pieces = type("NoPieces", (), {"append": {}, "lookup": staticmethod(lambda t: None)})()
    deltas, hit = [], None
    for i in ids:
        hit = detok.add_token(i)
        deltas.append(detok.take(final=hit is not None))
        if hit:
            break
    if not hit:
        deltas.append(detok.take(final=True))
    return deltas, hit


def _trained_tokenizer_dir(tmp_path, kind: str):
    """A small tokenizer of another decoder family (byte-level BPE, WordPiece), trained here."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    corpus = [t for t in TEXTS for _ in range(3)] + ["Once upon a time there was a little girl. She didn't know."]
    if kind == "bytelevel":
        tk = HFTokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<|end|>"])
    else:
        tk = HFTokenizer(models.WordPiece(unk_token="[UNK]"))
        tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tk.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "[SEP]"])
    tk.train_from_iterator(corpus, trainer)
    d = tmp_path / kind
    d.mkdir()
    tk.save(str(d / "tokenizer.json"))
    return d


@pytest.mark.parametrize("kind", ["bundled", "bytelevel", "wordpiece"])
def test_piece_table_path_gives_the_same_deltas_as_full_decodes(tokenizer, tmp_path, kind):
    """Random token streams (byte pieces, specials, lone spaces and all) stream the same deltas
    with the per-token table as with two decodes per token, and most tokens take the table."""
    import random

    tk = tokenizer if kind == "bundled" else Tokenizer(_trained_tokenizer_dir(tmp_path, kind))
    rng = random.Random(0)
    natural = [tk.encode(t, add_special_tokens=False) for t in TEXTS]
    for trial in range(40):
        prompt = [rng.randrange(tk.vocab_size) for _ in range(rng.randrange(1, 8))]
        if trial % 2:
            ids = [rng.randrange(tk.vocab_size) for _ in range(60)]
        else:
            ids = natural[trial % len(natural)]
        stop = ["e b"] if trial % 3 == 0 else []
        assert _stream(tk, prompt, ids, stop) == _stream(tk, prompt, ids, stop, slow=True)
    table = tk.piece_table(True)
    assert len(table.append) > len(table._rejected) > 0


def test_piece_table_keeps_partial_characters_out(tokenizer):
    table = tokenizer.piece_table(True)
    emoji = tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji) >= 4, "😀 must be spelled in byte-fallback tokens"
    assert all(table.lookup(t) is None for t in emoji[-4:])  # <0xF0> <0x9F> <0x98> <0x80>
    once = tokenizer.encode("a Once", add_special_tokens=False)[-1]
    assert table.lookup(once) == " Once" and table.alone[once] == "Once"
