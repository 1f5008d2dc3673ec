"""Overlapping pipeline stages: with --pipeline-parallel-size P > 1, up to P steps are in flight.

The running sequences form P disjoint groups (vLLM's virtual engines). A step is scheduled from the
sequences that are not in flight, submitted to the executor, and only then is the oldest in-flight
step collected and sampled, so stage 0 computes one group while stage 1 computes another. A group is
not a fixed label: a sequence belongs to the step that carries it until that step is collected, and
the scheduler never sees it meanwhile (it cannot schedule, preempt or evict it twice).

Outputs are those of the synchronous engine: each sequence's tokens come from its own forwards in
order, sampled with its own generator. The K/V cache needs no fence: every worker runs the steps in
submission order, so a block freed (an abort, a preemption) or registered in the prefix cache is
written and read by its stage's layers in the order the driver decided. A new step admits at most a
fair share (1/P) of the active sequences, so the groups stay balanced.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
from kvrelay.engine.parallel.remote_sampling import plan
from kvrelay.engine.prompt_logprobs import record_prompt_logprobs
from kvrelay.engine.scheduler import ScheduledStep


@dataclass
class _InFlight:
    step: ScheduledStep
    sample_idx: list[int]
    rows: list[int]
    prompt_spans: list[tuple[int, int, int]]  # (index in seqs, first position, rows) of prompt logprobs


class PipelineOverlap:
    """The engine's step for P > 1 overlapping stages; the engine keeps everything after sampling."""

    def __init__(self, engine, depth: int):
        self.engine = engine
        self.depth = depth
        self.in_flight: deque[_InFlight] = deque()

    def step(self) -> list:
        eng = self.engine
        step = self._schedule()
        if step.seqs:
            self._submit(step)
        outputs = eng._flush_deferred()  # the last collected step's text, while the stages compute
        if self.in_flight and (len(self.in_flight) >= self.depth or not step.seqs):
            return self._collect(outputs)
        return outputs

    def _schedule(self) -> ScheduledStep:
        """Schedule among the sequences no in-flight step carries, with a fair share of the slots."""
        sched = self.engine.scheduler
        busy = {seq for f in self.in_flight for seq in f.step.seqs}
        hidden = [seq for seq in sched.running if seq in busy]
        total = len(sched.running) + len(sched.waiting)
        limit = sched.config.max_num_seqs
        sched.running = [seq for seq in sched.running if seq not in busy]
        sched.config.max_num_seqs = min(limit - len(hidden), -(-total // self.depth))
        try:
            return sched.schedule()
        finally:
            sched.config.max_num_seqs = limit
            if hidden:
                sched.running = sorted(sched.running + hidden, key=sched._key)

    def _submit(self, step: ScheduledStep) -> None:
        eng = self.engine
        now = time.monotonic()
        for seq in step.seqs:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        scoring = frozenset(i for i, s in enumerate(step.seqs) if s.prompt_lps is not None
                            and s.num_computed < s.prompt_len - 1)
        extra = {"prompt_rows": scoring} if scoring else {}
        built = eng.runner.inputs.build(step.seqs, step.num_new, **extra)
        sampling = None  # the last stage samples the plain rows itself (remote_sampling.py)
        if eng.runner.sample_on_worker and built.sample_idx and not scoring:
            sampling = plan(step.seqs, built.sample_idx)
        eng.executor.submit(built.batch, sampling)
        self.in_flight.append(_InFlight(step, built.sample_idx, built.logits_rows, built.prompt_spans))

    def _collect(self, flushed: list) -> list:
        done = self.in_flight.popleft()
        logits = self.engine.executor.collect()
        if not isinstance(logits, torch.Tensor):  # RemoteLogits: the sampling rows, no prompt rows
            return self.engine._after_forward(done.step, {}, logits, done.sample_idx, done.rows, flushed)
        start = sum(done.rows)
        if done.prompt_spans:  # prompt logprobs: their rows follow the sampling rows
            spans = []
            for i, pos, n in done.prompt_spans:
                spans.append((i, pos, logits[start : start + n]))
                start += n
            record_prompt_logprobs(done.step.seqs, spans)
        logits = logits[: sum(done.rows)] if done.sample_idx else None
        return self.engine._after_forward(done.step, {}, logits, done.sample_idx, done.rows, flushed)
