"""Rows sampled on the parallel worker, merged with rows sampled on the driver: every row's token
and logprobs are those of sampling the whole batch in one place (parallel/remote_sampling.py)."""

from __future__ import annotations

import random

import torch
from kvrelay.engine.parallel.remote_sampling import RemoteLogits, RowSampling, SamplingPlan, sample_on_worker
from kvrelay.engine.sampler import pick, raw_log_softmax

VOCAB = 300
ROWS = [  # greedy, tempered, filtered, with and without logprobs (top-k of different sizes)
    RowSampling(0.0, 0, 1.0, 0.0, None),
    RowSampling(0.8, 20, 1.0, 0.0, 2),
    RowSampling(1.0, 0, 0.9, 0.0, None),
    RowSampling(0.0, 0, 1.0, 0.0, 0),
    RowSampling(0.7, 0, 1.0, 0.05, 5),
    RowSampling(1.2, 0, 1.0, 0.0, None),
    RowSampling(0.0, 0, 1.0, 0.0, 3),
]


def _whole(logits: torch.Tensor, uniforms: list[float]):
    want = [i for i, p in enumerate(ROWS) if p.logprobs is not None]
    s = pick(logits.clone(), ROWS, uniforms, raw_log_softmax(logits, want))
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
        return pick(rest, ps, host_uniforms, raw_log_softmax(rest, want))

    s = reply.sample_rest(list(range(len(params))), on_driver)
    tokens = s.tokens.tolist()
    return tokens, s.logprobs(tokens)


def test_split_sampling_equals_sampling_the_whole_batch():
    rng = random.Random(0)
    for trial in range(20):
        logits = torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(trial)) * 3
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
        logits = torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(100 + trial)) * 3
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
