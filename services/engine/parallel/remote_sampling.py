"""Sampling on the parallel worker that computed the logits, so a step's reply carries token ids
instead of [rows, vocab] fp32 logits.

A step's logits travel from TP rank 0 of the last stage to the driver through a pipe: 65.7 MB for
128 rows of a 128k vocabulary, 149 ms per step to encode, send and decode on the 2-core VM, where a
decode step on an H200 takes 2-13 ms. Most rows need nothing from the driver to be sampled but a
few numbers: logits processors and grammars read state that lives on the driver, and stay there.
For the other rows the driver sends each row's temperature, top-k, top-p, min-p, logprobs count,
penalties with the token ids they read, logit bias and active min_tokens ban, and its uniform,
drawn from the sequence's own stream as the driver's sampler draws it; the worker edits the row as
the driver's sampler would (penalties, bias, then the ban) and runs the driver's own
`sampler.pick`. The reply keeps the full logits only of the other rows.

A row with penalties sends its token ids (int32, 4 bytes a token: 8 KB at 2k tokens against 512 KB
of logits at a 128k vocabulary). Under async scheduling its last token may still be PENDING in
token_ids; with the executor the previous step's samples are on the driver already, and the plan
takes it from there (the late sample on the driver would read the same token).

Only plain steps are planned: speculative verification (every proposed token's logits) and prompt
logprobs keep the whole logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from kvrelay.engine.sampler import (
    Penalties,
    Sampled,
    penalize,
    penalties_of,
    pick,
    raw_log_softmax,
    to_device,
)
from kvrelay.engine.sequence import Sequence


class RowSampling(NamedTuple):
    """What sampling one row needs once its logits are final (sampler.pick reads these fields)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    logprobs: int | None
    bias: tuple[list[int], list[float]] | None = None  # logit_bias: token ids, values
    ban: list[int] | None = None  # min_tokens not reached yet: the stop ids, banned
    penalties: Penalties | None = None  # its output an int32 array


@dataclass
class SamplingPlan:
    """Sent with a step: the rows of its logits the worker samples (in sampling order, each a
    sequence's single row), their parameters, and the uniforms of those with temperature > 0."""

    rows: list[int]  # positions among the step's sampling rows (= rows of its logits)
    params: list[RowSampling]
    uniforms: list[float]


def plan(seqs: list[Sequence], sample_idx: list[int], token_src: dict[int, int] | None = None,
         prev_tokens: torch.Tensor | None = None) -> SamplingPlan | None:
    """The plan of a step whose sampling rows are seqs[i] for i in sample_idx, one row each; draws
    the planned rows' uniforms now (each sequence draws one per token, in order, wherever it is
    sampled). token_src, prev_tokens: seqs[i]'s last token, PENDING in token_ids, is
    prev_tokens[token_src[i]], a host tensor (async scheduling under the executor, whose samples
    come back to the driver). None when no row can be sampled on the worker."""
    rows, params, uniforms = [], [], []
    for j, i in enumerate(sample_idx):
        seq = seqs[i]
        p = seq.params
        if seq.grammar is not None or seq.processors or seq.allowed_ids is not None:
            continue  # reads the matcher or the plugins' state, or masks all but a few ids: the driver samples it
        penalties = penalties_of(seq)
        if penalties is not None:
            output = penalties.output
            if output and output[-1] < 0:  # PENDING: its last token is still in flight
                if prev_tokens is None or not token_src or i not in token_src:
                    continue  # on no host yet: the driver samples it once it has it
                output = output[:-1] + [int(prev_tokens[token_src[i]])]
            penalties = penalties._replace(output=np.array(output, dtype=np.int32))
        bias = ban = None
        if seq.logit_bias is not None:
            bias = (seq.logit_bias[0].tolist(), seq.logit_bias[1].tolist())
        if seq.num_generated < p.min_tokens and seq.ban_ids is not None:
            ban = seq.ban_ids.tolist()
        rows.append(j)
        params.append(RowSampling(p.temperature, p.top_k, p.top_p, p.min_p, p.logprobs, bias, ban, penalties))
        if p.temperature != 0.0:
            uniforms.append(seq.rng.random())
    return SamplingPlan(rows, params, uniforms) if rows else None


def sample_on_worker(logits: torch.Tensor, plan: SamplingPlan | None):
    """TP rank 0 of the last stage: the reply's payload for the driver (numpy arrays)."""
    if plan is None:
        return logits.cpu().numpy()
    every = len(plan.rows) == logits.shape[0]  # the common step: no row needs the driver
    mine = logits if every else logits.index_select(0, to_device(plan.rows, logits.device, torch.int64))
    want = [i for i, p in enumerate(plan.params) if p.logprobs is not None]
    raw = raw_log_softmax(mine, want)  # of the logits as the model gave them, as the driver's sampler
    penalised = [r for r, p in enumerate(plan.params) if p.penalties is not None]
    if penalised:  # then sampler._adjust's edits, in its order
        penalize(mine, penalised, [plan.params[r].penalties for r in penalised])
    for r, p in enumerate(plan.params):
        if p.bias is not None:
            mine[r][to_device(p.bias[0], mine.device, torch.int64)] += to_device(
                p.bias[1], mine.device, torch.float32).to(mine.dtype)
        if p.ban is not None:
            mine[r].index_fill_(0, to_device(p.ban, mine.device, torch.int64), float("-inf"))
    s = pick(mine, plan.params, plan.uniforms, raw)
    planned = set(plan.rows)
    rest = [r for r in range(logits.shape[0]) if r not in planned]
    host = logits.index_select(0, to_device(rest, logits.device, torch.int64)) if rest else None
    return ("sampled", _np(host), _np(s.tokens), s.want_logprobs, s.top_k, _np(s.chosen), _np(s.top_vals),
            _np(s.top_idx))


def _np(t: torch.Tensor | None):
    return None if t is None else t.cpu().numpy()


def _t(a) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(a)


@dataclass
class RemoteLogits:
    """A step's reply with its planned rows sampled on the worker: the logits of the other sampling
    rows, in order. The engine hands it to the sampler as it would the logits."""

    rows: list[int]  # positions among the n sampling rows that the worker sampled, ascending
    sampled: Sampled  # theirs, in that order
    logits: torch.Tensor | None  # the other rows', in order

    @staticmethod
    def from_wire(payload, plan: SamplingPlan) -> RemoteLogits:
        _, host, tokens, want, top_k, chosen, top_vals, top_idx = payload
        return RemoteLogits(plan.rows, Sampled(_t(tokens), want, top_k, _t(chosen), _t(top_vals), _t(top_idx)),
                            _t(host))

    @property
    def n(self) -> int:
        return len(self.rows) + (0 if self.logits is None else self.logits.shape[0])

    def keep(self, keep: list[int]) -> RemoteLogits:
        """Only the sampling rows at positions `keep` (ascending), renumbered, as index_select would."""
        mine = {j: r for r, j in enumerate(self.rows)}
        host_of = {j: h for h, j in enumerate(j for j in range(self.n) if j not in mine)}
        rows = [n for n, j in enumerate(keep) if j in mine]
        host = [host_of[j] for j in keep if j not in mine]
        logits = self.logits.index_select(0, torch.tensor(host, dtype=torch.int64)) if host else None
        return RemoteLogits(rows, _select(self.sampled, [mine[j] for j in keep if j in mine]), logits)

    def sample_rest(self, seqs: list[Sequence], sample_host) -> Sampled:
        """Every row's Sampled: the worker's rows merged with sample_host(logits, their seqs, their
        positions) for the others."""
        mine = set(self.rows)
        host = [j for j in range(len(seqs)) if j not in mine]
        parts = [(self.rows, self.sampled)]
        if host:
            parts.append((host, sample_host(self.logits, [seqs[j] for j in host], host)))
        return _merge(len(seqs), parts)


def _select(s: Sampled, picked: list[int]) -> Sampled:
    """Rows `picked` of s (ascending), renumbered."""
    at = {r: n for n, r in enumerate(picked)}
    lp = [(at[r], k, w) for w, (r, k) in enumerate(zip(s.want_logprobs, s.top_k)) if r in at]
    ws = torch.tensor([w for _, _, w in lp], dtype=torch.int64)
    return Sampled(s.tokens[torch.tensor(picked, dtype=torch.int64)], [r for r, _, _ in lp], [k for _, k, _ in lp],
                   s.chosen[ws] if lp else None, s.top_vals[ws] if lp and s.top_vals is not None else None,
                   s.top_idx[ws] if lp and s.top_idx is not None else None)


def _merge(n: int, parts: list[tuple[list[int], Sampled]]) -> Sampled:
    """One Sampled of n rows from parts, each (its rows' positions, its Sampled), on the host."""
    tokens = torch.empty(n, dtype=torch.int64)
    entries = []  # (row, k, chosen, top values, top ids)
    for rows, s in parts:
        s = s.to_host()
        tokens[torch.tensor(rows, dtype=torch.int64)] = s.tokens
        for w, (r, k) in enumerate(zip(s.want_logprobs, s.top_k)):
            vals = s.top_vals[w, :k] if k else None
            idx = s.top_idx[w, :k] if k else None
            entries.append((rows[r], k, s.chosen[w], vals, idx))
    if not entries:
        return Sampled(tokens, [], [])
    entries.sort(key=lambda e: e[0])
    k = max(e[1] for e in entries)
    top_vals = top_idx = None
    if k:
        top_vals = torch.zeros((len(entries), k), dtype=torch.float32)
        top_idx = torch.zeros((len(entries), k), dtype=torch.int64)
        for w, (_, kk, _, vals, idx) in enumerate(entries):
            if kk:
                top_vals[w, :kk], top_idx[w, :kk] = vals, idx
    chosen = torch.stack([e[2] for e in entries]).float()
    return Sampled(tokens, [e[0] for e in entries], [e[1] for e in entries], chosen, top_vals, top_idx)
