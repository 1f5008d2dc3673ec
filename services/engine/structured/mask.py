"""Per-sequence grammar state and the token bitmask the sampler applies.

A sequence's matcher catches up lazily on the tokens it has not seen when its next row is masked, so
every way a token enters the sequence (sampling, the first token a prefill worker sampled, deferred
outputs) is covered, and recompute preemption (which keeps the generated tokens) needs nothing.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)



class GrammarState:
    """One sequence's matcher and how many of its generated tokens it has seen.

    With a reasoning model's think tokens (GuidedSpec.think_tokens) the grammar waits for the
    thinking to end: phase "first" (the first token may open a think block, or is the grammar's),
    "thinking" (unconstrained up to the end token), then "grammar" (every token constrained)."""

    __slots__ = ("consumed", "failed", "matcher", "phase", "think", "vocab")

    def __init__(self, matcher, vocab: int, think: tuple[int, int] | None = None, thinking: bool = False):
        self.matcher = matcher
        self.vocab = vocab  # the tokenizer's vocabulary: the bits the matcher fills
        self.consumed = 0
        self.failed = False  # a token outside the grammar entered the sequence: only EOS is allowed
        self.think = think
        self.phase = "grammar" if think is None else "thinking" if thinking else "first"

    @property
    def constraining(self) -> bool:
        """Every next token follows the matcher (speculation can then be verified against it)."""
        return self.phase == "grammar" and not self.failed

    def sync(self, output_ids: list[int]) -> None:
        self.advance(output_ids[self.consumed :])

    def advance(self, tokens: list[int]) -> None:
        """Consume tokens that entered the sequence (after the `consumed` already seen)."""
        self.consumed += len(tokens)
        if self.phase != "grammar" and tokens:
            start, end = self.think
            skip = 0
            if self.phase == "first":
                self.phase, skip = ("thinking", 1) if tokens[0] == start else ("grammar", 0)
            if self.phase == "thinking":
                if end not in tokens[skip:]:
                    return
                self.phase, skip = "grammar", tokens.index(end, skip) + 1
            tokens = tokens[skip:]
        if tokens and not self.failed and self.matcher.try_consume_tokens(tokens) != len(tokens):
            log.warning("structured output: a token outside the grammar was appended (%s); ending the "
                        "sequence", self.matcher.get_error() or "not allowed")
            self.failed = True

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, proposed to follow what the matcher has consumed, the grammar accepts
        (llguidance checks them without advancing the matcher)."""
        return 0 if self.failed or not tokens else self.matcher.validate_tokens(tokens)

    def fork(self):
        """A copy of the matcher to advance through proposals (llguidance's deep_copy shares the
        compiled grammar: well under a microsecond), or None when the grammar failed."""
        return None if self.failed else self.matcher.deep_copy()


def apply(logits: torch.Tensor, rows: list[int], seqs: list, stop_ids: list[frozenset[int]]) -> None:
    """Mask logits[rows] (fp32 [S, V], in place) to the tokens each sequence's grammar allows next.

    seqs[k] owns logits[rows[k]]. A row left with no allowed token (the grammar finished but
    min_tokens bans EOS, or a failed matcher) gets its stop ids back, so sampling never sees an
    all -inf row.
    """
    for seq in seqs:
        seq.grammar.sync(seq.output_ids)
    masked = [k for k, seq in enumerate(seqs) if seq.grammar.phase != "thinking"]  # thinking: unconstrained
    if not masked:
        return
    if len(masked) < len(seqs):
        rows, seqs, stop_ids = [rows[k] for k in masked], [seqs[k] for k in masked], [stop_ids[k] for k in masked]
    states = [seq.grammar for seq in seqs]
    mask_rows(logits, rows, [None if s.failed else s.matcher for s in states], stop_ids, states[0].vocab,
              any(s.adjusts_logits for s in seqs),
              also=[s.think[0] if s.phase == "first" else None for s in states])  # or the token opening a think block


def new_bitmask(rows: int, grammar_vocab: int) -> torch.Tensor:
    """An all-allowed bitmask of `rows` rows (llguidance's layout: int32 words, 32 tokens each)."""
    return torch.full((rows, (grammar_vocab + 31) // 32), -1, dtype=torch.int32)


def fill(bitmask_row: torch.Tensor, matcher) -> None:
    """One row of the bitmask: what matcher allows next (None: a failed grammar, nothing)."""
    if matcher is None:
        bitmask_row.zero_()
    else:
        matcher.unsafe_compute_mask_ptr(bitmask_row.data_ptr(), bitmask_row.shape[0] * 4)


def mask_rows(logits: torch.Tensor, rows: list[int], matchers: list, stop_ids: list[frozenset[int]],
              grammar_vocab: int, suspect: bool = False, also: list[int | None] | None = None) -> None:
    """Mask logits[rows] (fp32, in place) to what matchers[k] allows next (None: a failed grammar,
    only stop ids), and token also[k] where it is set. `suspect`: a ban or bias may have left only
    -inf among the allowed tokens."""
    bitmask = new_bitmask(len(rows), grammar_vocab)
    # One row at a time on this thread: a row costs microseconds, and llguidance's parallel
    # executor keeps worker threads spinning after each batch, which took the CPU from the forward
    # pass on a small machine (stories260K at batch 32: 10x slower steps). Called directly, as
    # llguidance.torch does: importing that module compiles its applier (seconds).
    for k, matcher in enumerate(matchers):
        fill(bitmask[k], matcher)
        if also is not None and also[k] is not None:
            bitmask[k].numpy().view(np.uint32)[also[k] // 32] |= np.uint32(1 << (also[k] % 32))
    apply_bitmask(logits, rows, bitmask, stop_ids, grammar_vocab, suspect or None in matchers)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, stop_ids: list[frozenset[int]],
                  grammar_vocab: int, suspect: bool = False) -> None:
    """Set logits[rows[k]] to -inf where bitmask row k forbids; a row left with nothing allowed
    gets its stop ids back (see apply)."""
    vocab = logits.shape[1]
    # One C pass unpacks the bits (token t is bit t % 32 of word t // 32, little-endian); ~10x
    # faster on CPU than shifting int32 words in torch, and no torch.compile (llguidance.torch's
    # applier) with its compiler toolchain and slow first call.
    width = min(vocab, grammar_vocab)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little").reshape(len(rows), -1)[:, :width]
    # Imported here: the sampler imports this module. Its pinned, non-blocking copies do not wait for
    # the forward that async scheduling launched right before sampling a grammar's row.
    from kvrelay.engine.sampler import to_device

    leading = rows == list(range(len(rows)))
    target = logits[: len(rows)] if leading else logits.index_select(0, to_device(rows, logits.device))
    if target.is_cpu:  # numpy's single-threaded fill: torch's masked_fill_ is ~2x slower here on 2 cores
        np.copyto(target.numpy()[:, :width], -np.inf, where=bits == 0)
    else:
        target[:, :width].masked_fill_(to_device(torch.from_numpy(bits == 0), target.device), float("-inf"))
    if vocab > width:  # the model's padded vocabulary: ids past the tokenizer's are never text
        target[:, width:] = float("-inf")
    if suspect or not bool(bitmask.any(dim=1).all()):
        dead = (target.max(dim=-1).values == float("-inf")).nonzero().flatten().tolist()
        for k in dead:
            ids = sorted(stop_ids[k])
            if ids:
                target[k, ids] = 0.0
            else:  # nothing can end it either: leave the row unconstrained rather than sample from nothing
                target[k] = logits[rows[k]]
    if not leading:
        logits.index_copy_(0, to_device(rows, logits.device), target)
