"""Rows sampled on the parallel worker, merged with rows sampled on the driver: every row's token
and logprobs are those of sampling the whole batch in one place (parallel/remote_sampling.py)."""

from __future__ import annotations

import random

import numpy as np
import torch
from kvrelay.engine.parallel.remote_sampling import RemoteLogits, RowSampling, SamplingPlan, sample_on_worker
from kvrelay.engine.sampler import Penalties, penalize, pick, raw_log_softmax

VOCAB = 300
_PROMPT, _OUTPUT = np.array([5, 7, 7, 250], dtype=np.int32), np.array([12, 7, 99, 5, 5], dtype=np.int32)
ROWS = [  # greedy, tempered, filtered, with and without logprobs (top-k of different sizes), penalised
    RowSampling(0.0, 0, 1.0, 0.0, None),
    RowSampling(0.8, 20, 1.0, 0.0, 2),
    RowSampling(1.0, 0, 0.9, 0.0, None),
    RowSampling(0.0, 0, 1.0, 0.0, 0),
    RowSampling(0.7, 0, 1.0, 0.05, 5),
    RowSampling(1.2, 0, 1.0, 0.0, None),
    RowSampling(0.0, 0, 1.0, 0.0, 3),
    RowSampling(0.0, 0, 1.0, 0.0, 2, penalties=Penalties(1.8, 0.0, 0.0, _PROMPT, _OUTPUT)),
    RowSampling(0.9, 0, 1.0, 0.0, None, penalties=Penalties(1.0, 1.5, 2.0, _PROMPT, _OUTPUT)),
]


def _penalized(logits: torch.Tensor, params: list[RowSampling]) -> torch.Tensor:
    """The driver's edits: each penalised row as sampler._adjust edits it."""
    logits = logits.clone()
    rows = [r for r, p in enumerate(params) if p.penalties is not None]
    penalize(logits, rows, [params[r].penalties._replace(output=params[r].penalties.output.tolist()) for r in rows])
    return logits


def _whole(logits: torch.Tensor, uniforms: list[float]):
    want = [i for i, p in enumerate(ROWS) if p.logprobs is not None]
    s = pick(_penalized(logits, ROWS), ROWS, uniforms, raw_log_softmax(logits, want))
    tokens = s.tokens.tolist()
    return tokens, s.logprobs(tokens)


def _split(logits: torch.Tensor, uniforms: list[float], remote: list[int]) -> RemoteLogits:
    """What the worker replies when it samples rows `remote` and the driver keeps the others."""
    it = iter(uniforms)
    per_row = [next(it) if p.temperature != 0.0 else None for p in ROWS]
    plan = SamplingPlan(remote, [ROWS[j] for j in remote], [per_row[j] for j in remote if per_row[j] is not None])
    reply = RemoteLogits.from_wire(sample_on_worker(logits.clone(), plan), plan)
    reply.host_uniforms = [u for j, u in enumerate(per_row) if j not in remote and u is not None]
    return reply


def _finish(reply: RemoteLogits, params: list[RowSampling], host_uniforms: list[float]):
    def on_driver(rest, _seqs, rows):
        ps = [params[j] for j in rows]
        want = [i for i, p in enumerate(ps) if p.logprobs is not None]
        return pick(_penalized(rest, ps), ps, host_uniforms, raw_log_softmax(rest, want))

    s = reply.sample_rest(list(range(len(params))), on_driver)
    tokens = s.tokens.tolist()
    return tokens, s.logprobs(tokens)


def _logits(seed: int) -> torch.Tensor:
    """Random logits whose penalised rows' best token is one their penalties push down."""
    logits = torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    logits[-2, 7] = logits[-2].max() + 1.0  # seen: repetition penalty
    logits[-1, 5] = logits[-1].max() + 3.0  # output twice: frequency and presence penalties
    return logits


def test_the_penalties_change_what_is_sampled():
    """Else the tests below could not tell a worker that skipped them."""
    logits = _logits(3)
    penalised = _penalized(logits, ROWS)
    assert penalised[-2].argmax() != logits[-2].argmax() and penalised[-1].argmax() != logits[-1].argmax()


def test_split_sampling_equals_sampling_the_whole_batch():
    rng = random.Random(0)
    for trial in range(20):
        logits = _logits(trial)
        uniforms = [rng.random() for p in ROWS if p.temperature != 0.0]
        want = _whole(logits, uniforms)
        remote = sorted(rng.sample(range(len(ROWS)), rng.randint(1, len(ROWS))))
        reply = _split(logits, uniforms, remote)
        assert (reply.logits is None) == (len(remote) == len(ROWS))
        assert _finish(reply, ROWS, reply.host_uniforms) == want, (trial, remote)


def test_keeping_some_rows_equals_sampling_only_those():
    """A late sample drops the rows of sequences that finished meanwhile (async scheduling)."""
    rng = random.Random(1)
    for trial in range(20):
        logits = _logits(100 + trial)
        uniforms = [rng.random() for p in ROWS if p.temperature != 0.0]
        tokens, lps = _whole(logits, uniforms)
        remote = sorted(rng.sample(range(len(ROWS)), rng.randint(1, len(ROWS))))
        reply = _split(logits, uniforms, remote)
        keep = sorted(rng.sample(range(len(ROWS)), rng.randint(1, len(ROWS))))
        kept = reply.keep(keep)
        drawing = [j for j, p in enumerate(ROWS) if j not in remote and p.temperature != 0.0]
        host_uniforms = [u for j, u in zip(drawing, reply.host_uniforms) if j in keep]
        got = _finish(kept, [ROWS[j] for j in keep], host_uniforms)
        assert got == ([tokens[j] for j in keep], [lps[j] for j in keep]), (trial, remote, keep)
