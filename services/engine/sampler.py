"""Turn next-token logits into tokens: penalties, logit bias, temperature, top-k/top-p/min-p, seeds, logprobs.

Each seeded sequence draws its noise from its own generator, so what it samples does not
depend on which other sequences share the batch.
"""

from __future__ import annotations

import torch
from kvrelay.engine.outputs import TokenLogprob
from kvrelay.engine.sequence import Sequence


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
    p = seq.params
    vocab = row.shape[0]
    if p.repetition_penalty != 1.0:
        seen = torch.unique(torch.tensor(seq.token_ids, dtype=torch.int64))
        seen = seen[seen < vocab]
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_generated:
        counts = torch.bincount(torch.tensor(seq.output_ids, dtype=torch.int64), minlength=vocab)[
            :vocab
        ].float()
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def _filter(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Mask tokens outside top-k / top-p / min-p with -inf, row-wise. logits [R, V] (tempered)."""
    vocab = logits.shape[1]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])
        remove = torch.arange(vocab)[None, :] >= ks[:, None]
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it stays).
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= torch.tensor(top_p)[:, None]
        remove[:, 0] = False
        logits = logits.scatter(1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))
    if any(m > 0 for m in min_p):
        probs = logits.softmax(dim=-1)
        threshold = torch.tensor(min_p)[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list]:
    """logits [S, V] fp32 (modified in place). Returns (token ids, TokenLogprob or None) per row."""
    raw_logprobs = None
    want_logprobs = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if want_logprobs:
        raw_logprobs = torch.log_softmax(logits[want_logprobs], dim=-1)

    for i, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            _apply_penalties(logits[i], seq)
        if seq.logit_bias is not None:
            ids, values = seq.logit_bias
            logits[i, ids] += values.to(logits.dtype)
        if seq.num_generated < p.min_tokens and seq.stop_ids:
            logits[i, list(seq.stop_ids)] = float("-inf")

    tokens = logits.max(dim=-1).indices  # argmax (first of ties too), 3x faster on CPU rows of 32k
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        rows = logits[sampled] / torch.tensor([seqs[i].params.temperature for i in sampled])[:, None]
        rows = _filter(
            rows,
            [seqs[i].params.top_k for i in sampled],
            [seqs[i].params.top_p for i in sampled],
            [seqs[i].params.min_p for i in sampled],
        )
        probs = rows.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for r, i in enumerate(sampled):
            noise[r].exponential_(generator=seqs[i].generator)
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p.
        tokens[sampled] = (probs / noise).argmax(dim=-1)

    token_list = tokens.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    for r, i in enumerate(want_logprobs):
        row = raw_logprobs[r]
        k = seqs[i].params.logprobs
        top = []
        if k:
            vals, idx = row.topk(k)
            top = list(zip(idx.tolist(), vals.tolist()))
        logprobs[i] = TokenLogprob(token_list[i], float(row[token_list[i]]), top)
    return token_list, logprobs
