"""Verification of proposed tokens against the target model's logits at every proposed position.

Proposals are deterministic (n-gram lookup, or a draft model's greedy tokens), so each proposed
token d has q(d) = 1 and the standard rejection rule becomes: accept d with probability p(d); on
rejection, draw from p with d removed (norm(max(0, p - q)) for a one-hot q). Every emitted token is
therefore distributed exactly as p, the target's distribution after temperature and top-k/p/min-p
(lossless). Greedy sequences accept the longest prefix equal to the target's argmax, plus the
target's next token. Uniforms come from the sequence's own random stream, so a seeded request gives
the same tokens whatever else shares the batch.

Constrained sequences (structured output): row i is masked by a fork of the sequence's matcher
advanced through the proposals before i (the state the plain sampler would mask that position
with, had those tokens been sampled), then the same rule runs. Proposals arrive cut to the prefix
the grammar accepts (speculator.py), so the fork takes every one. The sequence's own matcher never
sees a rejected token: it consumes the emitted tokens when it next masks (GrammarState.sync), as
it does sampled ones, so there is nothing to roll back.
"""

from __future__ import annotations

import torch
from kvrelay.engine.outputs import TokenLogprob
from kvrelay.engine.sampler import _draw, _filter, allow
from kvrelay.engine.sequence import Sequence
from kvrelay.engine.structured.mask import apply_bitmask, fill, new_bitmask


def _target_probs(rows: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The distribution the plain sampler draws from, for each row of logits [R, V]."""
    p = seq.params
    rows = rows / p.temperature
    if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0:
        n = rows.shape[0]
        rows = _filter(rows, [p.top_k] * n, [p.top_p] * n, [p.min_p] * n)
    return rows.softmax(dim=-1)


def speculates(seq: Sequence) -> bool:
    """Whether seq's sampling can be verified here: penalties and plugin logits processors depend
    on every earlier token, so a sequence with them samples one token per step. A grammar's mask
    depends on them too, but a fork of its matcher follows the proposals (_mask), once it constrains
    every token (not while a reasoning model thinks before it)."""
    p = seq.params
    return (p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and not seq.processors and (seq.grammar is None or seq.grammar.constraining))


def _adjust(rows: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The sampler's allowed ids, logit bias and min_tokens ban, for the token at each row's position."""
    if seq.allowed_ids is not None:
        allow(rows, seq.allowed_ids)
    if seq.logit_bias is not None:
        ids, values = seq.logit_bias
        rows[:, ids] += values.to(rows.dtype)
    banned = seq.params.min_tokens - seq.num_generated  # rows whose token may not stop the sequence
    if banned > 0 and seq.ban_ids is not None:
        rows[:banned].index_fill_(1, seq.ban_ids, float("-inf"))
    return rows


@torch.inference_mode()
def verify(seq: Sequence, logits: torch.Tensor, proposal: list[int]) -> tuple[list[int], list]:
    """logits [len(proposal) + 1, V] fp32: row i scores the token after proposal[:i]. Returns the
    emitted tokens (the accepted proposals, then one token of the target's) and their logprobs
    (TokenLogprob, or None when the request asked for none), from the raw logits as the sampler's."""
    k = len(proposal)
    raw = logits
    if seq.adjusts_logits or seq.grammar is not None:
        logits = logits.clone()
    if seq.adjusts_logits:
        _adjust(logits, seq)
    if seq.grammar is not None:  # after bias and bans, as in the sampler
        _mask(logits, seq, proposal)
    if seq.params.greedy:
        best = logits.max(dim=-1).indices.tolist()
        accepted = 0
        while accepted < k and proposal[accepted] == best[accepted]:
            accepted += 1
        emitted = proposal[:accepted] + [best[accepted]]
    else:
        probs = _target_probs(logits, seq)
        emitted = []
        for i, d in enumerate(proposal):
            if seq.rng.random() < float(probs[i, d]):
                emitted.append(d)
                continue
            rest = probs[i : i + 1].clone()
            rest[0, d] = 0.0
            if float(rest.sum()) <= 0.0:  # p was one-hot on d up to rounding: d it is
                emitted.append(d)
                continue
            emitted.append(int(_draw(rest, [seq.rng.random()])[0]))
            break
        else:
            emitted.append(int(_draw(probs[k : k + 1], [seq.rng.random()])[0]))
    return emitted, _logprobs(seq, raw[: len(emitted)], emitted)


def _mask(rows: torch.Tensor, seq: Sequence, proposal: list[int]) -> None:
    """The grammar's mask on each row i (in place), from a fork of seq's matcher advanced through
    proposal[:i]: the state the plain sampler would mask that position with."""
    state = seq.grammar
    state.sync(seq.output_ids)
    bitmask = new_bitmask(len(proposal) + 1, state.vocab)
    fork = state.fork()
    for i in range(len(proposal) + 1):
        fill(bitmask[i], fork)
        # A token the fork refuses (proposals are cut to what the grammar accepts: only EOS after
        # the grammar ended can be) fails it, as the plain sampler's matcher: only stop ids follow.
        if i < len(proposal) and fork is not None and fork.try_consume_tokens([proposal[i]]) != 1:
            fork = None
    apply_bitmask(rows, list(range(len(proposal) + 1)), bitmask, [seq.stop_ids] * (len(proposal) + 1),
                  state.vocab, seq.adjusts_logits)


def _logprobs(seq: Sequence, rows: torch.Tensor, tokens: list[int]) -> list:
    want = seq.params.logprobs
    if want is None:
        return [None] * len(tokens)
    lsm = torch.log_softmax(rows, dim=-1)
    out = []
    for row, token in zip(lsm, tokens):
        top = []
        if want:
            vals, idx = row.topk(want)
            top = list(zip(idx.tolist(), vals.tolist()))
        out.append(TokenLogprob(token, float(row[token]), top))
    return out
