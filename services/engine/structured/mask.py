"""Per-sequence grammar state and the token bitmask the sampler applies.

A sequence's matcher catches up lazily on the tokens it has not seen when its next row is masked, so
every way a token enters the sequence (sampling, the first token a prefill worker sampled, deferred
outputs) is covered, and recompute preemption (which keeps the generated tokens) needs nothing.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)
_EXECUTOR = None


def _executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


class GrammarState:
    """One sequence's matcher and how many of its generated tokens the matcher has consumed."""

    __slots__ = ("consumed", "failed", "matcher", "vocab")

    def __init__(self, matcher, vocab: int):
        self.matcher = matcher
        self.vocab = vocab  # the tokenizer's vocabulary: the bits the matcher fills
        self.consumed = 0
        self.failed = False  # a token outside the grammar entered the sequence: only EOS is allowed

    def sync(self, output_ids: list[int]) -> None:
        new = output_ids[self.consumed :]
        if new and not self.failed and self.matcher.try_consume_tokens(new) != len(new):
            log.warning("structured output: a token outside the grammar was appended (%s); ending the "
                        "sequence", self.matcher.get_error() or "not allowed")
            self.failed = True
        self.consumed = len(output_ids)


def apply(logits: torch.Tensor, rows: list[int], seqs: list, stop_ids: list[frozenset[int]]) -> None:
    """Mask logits[rows] (fp32 [S, V], in place) to the tokens each sequence's grammar allows next.

    seqs[k] owns logits[rows[k]]. A row left with no allowed token (the grammar finished but
    min_tokens bans EOS, or a failed matcher) gets its stop ids back, so sampling never sees an
    all -inf row.
    """
    vocab = logits.shape[1]
    bitmask = torch.full((len(rows), (seqs[0].grammar.vocab + 31) // 32), -1, dtype=torch.int32)
    live = []
    for k, seq in enumerate(seqs):
        state = seq.grammar
        state.sync(seq.output_ids)
        if state.failed:
            bitmask[k].zero_()
        else:
            live.append((state.matcher, k))
    # llguidance fills the rows in parallel on its own threads (with the GIL released); called
    # directly, as llguidance.torch does: importing that module compiles its applier (seconds).
    if len(live) == 1:
        matcher, k = live[0]
        row = bitmask[k]
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
    elif live:
        _executor().unsafe_compute_mask_ptr(live, bitmask.data_ptr(), bitmask.shape[1] * 4, len(rows))
    # Unpack 32 bits per word (llguidance.torch's applier is torch.compile'd: a compiler toolchain
    # and a slow first call on CPU); tokens past the grammar's vocabulary stay masked as bits of 0.
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().view(len(rows), -1)[:, : min(vocab, seqs[0].grammar.vocab)]
    if allowed.shape[1] < vocab:  # the model's padded vocabulary: rows past the tokenizer's are never text
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    sub = logits.index_select(0, index).masked_fill_(~allowed.to(logits.device), float("-inf"))
    dead = (sub.max(dim=-1).values == float("-inf")).nonzero().flatten().tolist()
    for k in dead:
        ids = sorted(stop_ids[k])
        if ids:
            sub[k, ids] = 0.0
        else:  # nothing can end it either: leave the row unconstrained rather than sample from nothing
            sub[k] = logits[rows[k]]
    logits.index_copy_(0, index, sub)
