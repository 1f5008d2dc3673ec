"""n-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from ngram_max down to ngram_min), in the prompt or the output so far.

Deterministic (its proposal distribution is one-hot), so verification treats it as a draft whose
q(d) = 1. The search is bytes.rfind over the token ids packed as int32: C speed, no model.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"--ngram-min {ngram_min} and --ngram-max {ngram_max}: need 1 <= min <= max")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens; [] when no suffix of ngram_min or more tokens occurred before."""
        length = len(tokens)
        if k <= 0 or length < self.ngram_min + 1:
            return []
        packed = np.asarray(tokens, dtype=np.int32).tobytes()
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            needle = packed[4 * (length - n) :]
            # An occurrence that ends before the last token, so at least one token follows it.
            end = 4 * (length - 1)
            while True:
                at = packed.rfind(needle, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:  # aligned on a token, not inside one
                    start = at // 4 + n
                    return tokens[start : start + k]
                end = at + len(needle) - 1
        return []
