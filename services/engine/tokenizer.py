"""Tokenizer from a model folder: tokenizer.json, tokenizer_config.json, chat template."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from kvrelay.engine.errors import InvalidRequestError, ModelLoadError
from tokenizers import Tokenizer as HFTokenizer

# Used when the model ships no chat template (the bundled stories model has none).
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing; kvrelay reads tokenizers in the HF tokenizer.json format")
        try:
            self._tk = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise ModelLoadError(f"{path}: cannot be parsed by the tokenizers library: {e}") from e
        config = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except json.JSONDecodeError as e:
                raise ModelLoadError(f"{config_path}: not valid JSON ({e})") from e
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tk.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tk.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next(
                (t["template"] for t in template if t.get("name") == "default"), template[0]["template"]
            )
        chat_file = model_dir / "chat_template.jinja"
        if template is None and chat_file.is_file():
            template = chat_file.read_text()
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.globals["raise_exception"] = self._raise
        self.set_chat_template(template)
        added = self._tk.get_added_tokens_decoder()  # id -> AddedToken
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._piece_tables: dict[bool, PieceTable] = {}
        # A twin that reads special-token text (e.g. "</s>") as plain text: for text from users.
        self._plain = HFTokenizer.from_file(str(path))
        self._plain.encode_special_tokens = True
        specials = sorted((t.content for i, t in added.items() if t.special and t.content), key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, specials))) if specials else None

    def set_chat_template(self, template: str | None) -> None:
        """Render chats with template (jinja2 source; None: a plain fallback), as `--chat-template`
        sets it. Raises jinja2.TemplateSyntaxError for a template that does not parse."""
        compiled = self._env.from_string(template or FALLBACK_CHAT_TEMPLATE)
        self.has_chat_template = template is not None
        self.chat_template_source = template or FALLBACK_CHAT_TEMPLATE  # read for the variables it uses
        self._chat_template = compiled

    @staticmethod
    def _raise(message: str):
        raise InvalidRequestError(f"chat template: {message}", field="messages")

    def vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included (a draft model's tokenizer is checked against it)."""
        return self._tk.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a long prompt tokenized
        # in a worker thread leaves the caller's event loop running.
        return self._tk.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_prompt(self, text: str) -> list[int]:
        """Encode a prompt; a prompt that already starts with the BOS text (from a chat template) gets no second BOS."""
        with_bos = not (self.bos_token and text.startswith(self.bos_token))
        return self.encode(text, add_special_tokens=with_bos)

    def encode_plain(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encode user text: special-token text in it stays text (only BOS/EOS the tokenizer's own
        post-processor adds are special)."""
        return self._plain.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """Two user texts as one input, joined by the tokenizer's pair template (a cross-encoder's
        query and document), special-token text kept as text."""
        return self._plain.encode_batch([(text, pair)])[0].ids

    def has_special_text(self, text: str) -> bool:
        return self._special_text is not None and self._special_text.search(text) is not None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Render the chat template and encode it, with only the template's own markers special:
        special-token text inside a message's content is encoded as plain text. kwargs: those of
        apply_chat_template, and the template's variables."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        if not any(self.has_special_text(t) for m in messages for t in _content_texts(m.get("content"))):
            return self.encode_prompt(text)  # nothing to forge: the common, fast path
        # Where is each content in the rendering? Render with sentinels in place of the contents (each
        # text part of a list content); the sentinels, replaced back, must give exactly the real
        # rendering (a template that rewrites content, e.g. `| trim`, cannot be mapped and is refused).
        contents: list[str] = []

        def mark(t: str) -> str:
            contents.append(t)
            return f"\ue000{len(contents) - 1}\ue001"

        marked_messages = []
        for m in messages:
            c = m.get("content")
            if isinstance(c, str):
                m = m | {"content": mark(c)}
            elif isinstance(c, list):
                m = m | {"content": [p | {"text": mark(p["text"])} if p.get("type") == "text" else p for p in c]}
            marked_messages.append(m)
        marked = self.apply_chat_template(marked_messages, add_generation_prompt, **kwargs)
        pieces = re.split("(\ue000\\d+\ue001)", marked)
        spans, rebuilt, pos = [], [], 0
        for piece in pieces:
            if re.fullmatch("\ue000\\d+\ue001", piece):
                piece = contents[int(piece[1:-1])]
                spans.append((pos, pos + len(piece)))
            rebuilt.append(piece)
            pos += len(piece)
        if "".join(rebuilt) != text:
            raise InvalidRequestError("messages: a message contains special-token text and this model's chat "
                                      "template rewrites message content, so it cannot be kept as plain text; "
                                      "remove the special-token text", field="messages")
        with_bos = not (self.bos_token and text.startswith(self.bos_token))
        enc = self._tk.encode_batch([text], add_special_tokens=with_bos)[0]
        out: list[int] = []
        for tid, (start, end) in zip(enc.ids, enc.offsets):
            if tid in self.special_ids and any(a <= start and end <= b for a, b in spans):
                out += self.encode_plain(text[start:end], add_special_tokens=False)
            else:
                out.append(tid)
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def decoder(self, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
        """decode with the flag bound, for per-token callers (no Python frames in between)."""
        return functools.partial(self._tk.decode, skip_special_tokens=skip_special_tokens)

    def piece_table(self, skip_special_tokens: bool = True) -> PieceTable:
        """The shared per-token text table for incremental decoding with this flag (built on first use)."""
        table = self._piece_tables.get(skip_special_tokens)
        if table is None:
            table = self._piece_tables[skip_special_tokens] = PieceTable(self, skip_special_tokens)
        return table

    def token_to_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary (added tokens too), by its text; None if there is none."""
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs) -> str:
        """continue_final_message: the text ends right after the final message's content (an
        assistant turn the model is to continue), as in transformers."""
        try:
            text = self._chat_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        # A request's template variables of an unexpected type fail inside the template as Python errors.
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise InvalidRequestError(
                f"messages: the chat template cannot render them: {type(e).__name__}: {e}", field="messages"
            ) from e
        if continue_final_message:
            final = messages[-1].get("content") or ""
            for piece in (final, final.strip()):  # templates may strip the content
                if piece and piece in text:
                    return text[: text.rindex(piece) + len(piece)]
            raise InvalidRequestError("continue_final_message: this model's chat template does not render the "
                                      "final message's content as sent, so it cannot be continued",
                                      field="continue_final_message")
        return text


class PieceTable:
    """Per-token text, for tokens whose text does not depend on their neighbours.

    `append[t]` is the text token t adds after other text, `alone[t]` is decode([t]). A token
    is kept only if it adds the same non-empty text after two different left contexts, leaves
    that context's text unchanged, and holds no partial UTF-8 character (byte-fallback pieces,
    byte-level fragments). Decoders that rewrite earlier text therefore never enter the table,
    and such tokens take the full decode path.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self._decode = tokenizer.decoder(skip_special_tokens)
        self._contexts: list[list[int]] = []  # two left contexts with distinct, clean text
        seen = set()
        for text in ("a b", "Hello", "the", "x", "I", "0"):
            ctx = tokenizer.encode(text, add_special_tokens=False)
            shown = self._decode(ctx)
            if shown and "\ufffd" not in shown and shown not in seen and len(self._contexts) < 2:
                self._contexts.append(ctx)
                seen.add(shown)
        self.append: dict[int, str] = {}
        self.alone: dict[int, str] = {}
        self._rejected: set[int] = set()

    def lookup(self, token_id: int) -> str | None:
        """The text token_id adds after other text, or None when only a full decode can tell."""
        piece = self.append.get(token_id)
        if piece is not None or token_id in self._rejected:
            return piece
        piece = self._learn(token_id)
        if piece is None:
            self._rejected.add(token_id)
        return piece

    def _learn(self, token_id: int) -> str | None:
        if len(self._contexts) < 2:
            return None
        pieces = set()
        for ctx in self._contexts:
            before, after = self._decode(ctx), self._decode(ctx + [token_id])
            if not after.startswith(before):
                return None
            pieces.add(after[len(before) :])
        if len(pieces) != 1:
            return None
        piece = pieces.pop()
        if not piece or "\ufffd" in piece:
            return None
        self.alone[token_id] = self._decode([token_id])
        self.append[token_id] = piece
        return piece


def _content_texts(content) -> list[str]:
    """A chat message's text: its content string, or its list content's text parts."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return []
