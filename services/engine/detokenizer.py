"""Incremental detokenization and stop strings.

Text is emitted as the difference between decoding a short window of tokens with and
without the newest ones, so it never ends inside a UTF-8 character split over byte-fallback
tokens, and leading-space rules of the decoder apply exactly as in a full decode.
Text that could be the start of a stop string is held back until it is known not to be one.

Most tokens skip both decodes: when no bytes are pending and the window already shows text,
a token from the tokenizer's PieceTable adds its known text, and the window moves exactly as a
full decode would have moved it.
"""

from __future__ import annotations

from kvrelay.engine.tokenizer import Tokenizer

CONTEXT_TOKENS = 6  # prompt tokens used as left context for the first generated token


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str], skip_special: bool = True,
        keep_stop: bool = False,
    ):
        self._decode = tokenizer.decoder(skip_special)
        self._pieces = tokenizer.piece_table(skip_special)
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.prefix_text = self._decode(self.ids)
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.keep_stop = keep_stop  # include_stop_str_in_output: the text ends with the stop string
        self.text = ""  # all text decoded so far (truncated at a stop string)
        self.emitted = 0  # characters of self.text already handed out
        self.stopped = False

    def add_token(self, token_id: int) -> str | None:
        """Feed one token; returns the stop string if the text now contains one."""
        ids = self.ids
        # Nothing pending, and the window shows text that does not end in a partial character.
        if self.read_offset == len(ids) and self.prefix_text and self.prefix_text[-1] != "\ufffd":
            pieces = self._pieces
            piece = pieces.append.get(token_id)  # known pieces inline: this runs per token
            if piece is None:
                piece = pieces.lookup(token_id)
            if piece is not None:
                ids.append(token_id)
                self.prefix_offset = self.read_offset
                self.read_offset += 1
                self.prefix_text = pieces.alone[token_id]
                if not self.stop:
                    self.text += piece
                    return None
                return self._append(piece)
        ids.append(token_id)
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(self.prefix_text) or new_text.endswith("\ufffd"):
            return None  # incomplete character, or nothing visible yet
        delta = new_text[len(self.prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        return self._append(delta)

    def _append(self, delta: str) -> str | None:
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        if not self.stop:
            return None
        best = None
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[: best[0] + (len(best[1]) if self.keep_stop else 0)]
        self.stopped = True
        return best[1]

    def take(self, final: bool = False) -> str:
        """The text not handed out yet, minus a tail that may still become a stop string."""
        if not final and not self.stop:
            out = self.text[self.emitted :]
            self.emitted = len(self.text)
            return out
        if final:
            # Flush bytes still waiting to complete a character.
            rest = self._decode(self.ids[self.prefix_offset :])
            if len(rest) > len(self.prefix_text) and not self.stopped:
                self.text += rest[len(self.prefix_text) :]
                self.prefix_text = rest
            end = len(self.text)
        else:
            end = len(self.text) - (self._held_back() if self.stop else 0)
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for n in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
