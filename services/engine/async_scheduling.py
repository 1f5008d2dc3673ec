"""Async scheduling (--async-scheduling): the host schedules and launches step N+1 before it reads
step N's sampled tokens, then turns step N's tokens into outputs while the device runs N+1.

On a GPU a step's launch returns at once, so the host's work per step (scheduling, batch building,
sampling's launches, detokenizing, stop checks) hides behind the device's instead of adding to it.
On CPU every op finishes before it returns: the same code runs, one step behind, for no gain.

How a sequence runs one step ahead of its tokens:
- When step N samples, each sampling sequence gets a PENDING entry where its token will go, so
  the scheduler sees one more token to compute and schedules it in step N+1 as a decode.
- Step N+1's input for that row is copied on the device from step N's sampled tokens
  (InputBatch's token_src), so nothing waits for step N on the host.
- Step N's tokens come back in one non-blocking copy to pinned memory. Once step N+1 is launched
  the host waits for that copy alone, writes the tokens over the PENDING entries, registers the
  blocks they filled in the prefix cache, and runs the stop checks. A sequence that stopped at N
  computed one row in N+1 for nothing: that row is dropped, as the synchronous engine never
  computes it. A sequence that ends by length at N gets no PENDING entry, so it is not scheduled.

Outputs are the synchronous engine's: the same forwards in the same order per sequence, each
seeded sequence drawing its uniforms from its own stream in token order. Freed and reused blocks
need no fence: the device runs steps in launch order, so a block freed while step N+1 is in
flight is written by a later step only after N+1 is done with it.

Logprobs and prompt logprobs are computed on the device at launch and come back in the same
copy as the tokens. A sequence whose sampling reads its history on the host (logits processors, a
grammar; penalties count the token in flight on the device) samples late: step N+1's forward is
launched, then step N's tokens are collected (the forward runs meanwhile), then step N+1 samples
with every token on the host. Only a sequence preempted and scheduled again makes a step wait for
the previous one's tokens before its forward (no overlap).

With speculative decoding, a step that may speculate (Speculator.may_propose: a decode in a batch of
at most --speculative-disable-batch-size sequences, or a seeded one) runs as the synchronous engine
runs it, after the step in flight is collected: proposals read every token on the host. Larger
batches, where speculation is off, overlap.

With tensor parallelism the worker processes run the forward and the driver samples from the logits
they send back, so every step samples late: the driver sends step N+1 (its decodes' input ids copied
from step N's samples, already on the driver), turns step N's tokens into outputs while the workers
compute, then reads step N+1's logits and samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from kvrelay.engine.outputs import RequestOutput
from kvrelay.engine.prompt_logprobs import PromptScores, score_prompt
from kvrelay.engine.sampler import Sampled, sample_on_device, to_device
from kvrelay.engine.scheduler import ScheduledStep
from kvrelay.engine.sequence import Sequence, Status

FINISHED = Status.FINISHED
PENDING = -1  # where a token sampled by a step still on the device will go in token_ids


@dataclass
class _InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    computed: list[Sequence]  # every sequence the step computed (their full blocks register on collect)
    seqs: list[Sequence]  # the sequences that sampled, in the order of sampled.tokens
    slots: list[int]  # where each one's token goes in its token_ids
    on_device: torch.Tensor | None  # the sampled tokens on the device: the next step's inputs
    sampled: Sampled | None  # tokens and logprobs on the host (pinned on CUDA), filled by `ready`
    scores: PromptScores | None  # prompt logprobs of the step's prefill rows, likewise on the host
    ready: torch.cuda.Event | None  # CUDA: recorded after the copies to the host


@dataclass
class _Launched:
    """A step whose forward is launched and whose sampling is not, yet."""

    step: ScheduledStep
    logits: torch.Tensor  # of the rows that sample, in sample_idx order
    sample_idx: list[int]
    token_src: dict[int, int] | None  # row -> the previous step's sampled row that is its input
    scores: PromptScores | None


class AsyncScheduling:
    """The engine's step with async scheduling; the engine keeps requests, outputs and finishing."""

    def __init__(self, engine):
        self.engine = engine
        self.in_flight: _InFlight | None = None
        # Steps launched while the previous one was in flight, of those the steps that sampled after
        # collecting it (late), and steps that waited for its tokens before their forward.
        self.overlapped_steps = 0
        self.late_sampled_steps = 0
        self.waited_steps = 0
        self.speculative_steps = 0  # steps that may speculate, run synchronously

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        step = eng.scheduler.schedule()
        if eng.speculator is not None and step.seqs and eng.speculator.may_propose(step):
            return self._speculative_step(step)
        prev, self.in_flight = self.in_flight, None
        outputs: list[RequestOutput] = []
        how = self._overlap(step, prev) if prev is not None and step.seqs else "wait"
        if prev is not None and how == "wait":
            self.waited_steps += bool(step.seqs)
            outputs = self._collect(prev)  # this step needs the tokens on the host first
            prev = None
            step = _without_finished(step)
        if not step.seqs:
            return outputs
        _scheduled_now(step)
        if prev is not None and eng.executor is not None:
            how = "late"  # the driver samples from logits the workers send back: collect while they compute
        collected: list[RequestOutput] = []
        meanwhile = None
        if prev is not None and how == "late":  # sampling reads the history on the host: collect while the forward runs
            meanwhile = lambda: collected.extend(self._collect(prev))
        launched = self._forward(step, prev, meanwhile)
        if prev is not None:
            self.overlapped_steps += 1
            if how == "late":
                self.late_sampled_steps += 1
                outputs, prev = collected, None
        self.in_flight = self._sample(launched, prev)
        if prev is not None:
            outputs = self._collect(prev)
        return outputs

    def _speculative_step(self, step: ScheduledStep) -> list[RequestOutput]:
        """A step that may speculate runs as the synchronous engine runs it: proposals read every
        token on the host, so the step in flight is collected first, and this one's tokens are read
        (and made into outputs) before the next step is scheduled."""
        eng = self.engine
        outputs: list[RequestOutput] = []
        if self.in_flight is not None:
            prev, self.in_flight = self.in_flight, None
            self.waited_steps += 1
            outputs = self._collect(prev)
            step = _without_finished(step)
            if not step.seqs:
                return outputs
        self.speculative_steps += 1
        _scheduled_now(step)
        outputs += eng._speculative_step(step)
        return outputs + eng._flush_deferred()  # nothing of it may wait for a step that overlaps

    def _overlap(self, step: ScheduledStep, prev: _InFlight) -> str:
        """How step can run while prev is in flight: "overlap" (forward and sampling before prev's
        tokens are read), "late" (its sampling needs them on the host), or "wait" (its forward does)."""
        how = "overlap"
        for seq, n in zip(step.seqs, step.num_new):
            # A PENDING token is only ever the input of a decode row (not of a recomputed prompt).
            if seq.token_ids[-1] == PENDING and (n != 1 or seq.num_computed != seq.num_tokens - 1):
                return "wait"
            # Logits processors and grammars read every earlier token on the host. Penalties do not:
            # they take the token in flight from the device (sampler._adjust's pending).
            if seq.processors or seq.grammar is not None:
                how = "late"
        return how

    def _forward(self, step: ScheduledStep, prev: _InFlight | None, meanwhile=None) -> _Launched:
        eng = self.engine
        token_src = None
        if prev is not None:
            row_of = {seq: r for r, seq in enumerate(prev.seqs)}
            token_src = {i: row_of[seq] for i, seq in enumerate(step.seqs) if seq.token_ids[-1] == PENDING}
        scoring = frozenset(i for i, s in enumerate(step.seqs) if s.prompt_lps is not None
                            and s.num_computed < s.prompt_len - 1)
        logits, sample_idx, _ = eng.runner.execute(step.seqs, step.num_new, frozenset(), scoring, token_src,
                                                   prev.on_device if token_src else None, meanwhile)
        scores = score_prompt(step.seqs, eng.runner.prompt_logits).to_host(blocking=False) if scoring else None
        for seq, n in zip(step.seqs, step.num_new):
            seq.num_computed += n
        return _Launched(step, logits, sample_idx, token_src, scores)

    def _sample(self, f: _Launched, prev: _InFlight | None) -> _InFlight:
        """prev: still in flight, so each row's input token may be on the device only (penalties
        count it from there); None: every token is on the host (a late sample, or no overlap)."""
        eng, step = self.engine, f.step
        sample_idx, logits = f.sample_idx, f.logits
        if prev is None and any(step.seqs[i].status is FINISHED for i in sample_idx):
            # A late sample after the collect that finished these: the synchronous engine never samples them.
            keep = [j for j, i in enumerate(sample_idx) if step.seqs[i].status is not FINISHED]
            sample_idx = [sample_idx[j] for j in keep]
            # A tensor, or a parallel worker's reply with rows it sampled (parallel/remote_sampling.py)
            if keep:
                logits = logits.index_select(0, to_device(keep, logits.device, torch.int64)) if isinstance(
                    logits, torch.Tensor) else logits.keep(keep)
        if not sample_idx:
            return _InFlight(step.seqs, [], [], None, None, f.scores, _copied(eng.runner.device))
        seqs = [step.seqs[i] for i in sample_idx]
        pending = None
        if f.token_src and prev is not None:  # penalties count each sequence's token in flight from the device
            tokens = prev.on_device
            pending = {j: tokens[f.token_src[i]:f.token_src[i] + 1] for j, i in enumerate(sample_idx)
                       if seqs[j].adjusts_logits and i in f.token_src}
        sampled = sample_on_device(logits, seqs, wait_free=True, pending=pending)
        slots = []
        for seq in seqs:
            ids = seq.token_ids
            slots.append(len(ids))
            if len(ids) - seq.prompt_len + 1 < seq.max_tokens:  # else it ends by length: nothing to schedule
                ids.append(PENDING)
        host = sampled.to_host(blocking=False)
        return _InFlight(step.seqs, seqs, slots, sampled.tokens, host, f.scores, _copied(eng.runner.device))

    def _collect(self, f: _InFlight) -> list[RequestOutput]:
        """Step f's tokens into token_ids, its filled blocks into the prefix cache, then outputs."""
        eng = self.engine
        # Per sequence per step: status and len(token_ids) are read directly, not through properties.
        if f.ready is not None:
            f.ready.synchronize()  # this step's copies only; the next step keeps running
        if f.scores is not None:  # before the outputs: the first one carries them
            f.scores.record(f.computed)
        tokens: list[int] = []
        if f.sampled is not None:
            tokens = f.sampled.tokens.tolist()
            for seq, slot, token in zip(f.seqs, f.slots, tokens):
                if seq.status is not FINISHED:  # else aborted since (its PENDING entries were dropped)
                    ids = seq.token_ids
                    if slot < len(ids):
                        ids[slot] = token
                    else:
                        ids.append(token)
        bs = eng.args.block_size
        register = eng.scheduler.register_full_blocks
        for seq in f.computed:  # every input token of the step is on the host now
            if seq.num_computed // bs > seq.num_registered and seq.status is not FINISHED:
                register(seq)
        if f.sampled is None:
            return []
        outputs = []
        now = time.monotonic()
        settle = eng._settle_token
        for seq, slot, token, lp in zip(f.seqs, f.slots, tokens, f.sampled.logprobs(tokens)):
            if seq.status is FINISHED:
                continue
            ids = seq.token_ids
            ahead = len(ids) > slot + 1  # the PENDING entry of the step launched since
            if ahead:
                ids.pop()
            outputs.append(settle(seq, token, lp, now))
            if ahead and seq.status is not FINISHED:
                ids.append(PENDING)
        return outputs


def _scheduled_now(step: ScheduledStep) -> None:
    now = time.monotonic()
    for seq in step.seqs:
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = now


def _copied(device: torch.device) -> torch.cuda.Event | None:
    """CUDA: an event recorded after the step's copies to the host were queued; None on CPU."""
    if device.type != "cuda":
        return None
    ready = torch.cuda.Event()
    ready.record()
    return ready


def _without_finished(step: ScheduledStep) -> ScheduledStep:
    """The step less the sequences that finished while it waited (their blocks are freed)."""
    keep = [k for k, seq in enumerate(step.seqs) if not seq.finished]
    if len(keep) == len(step.seqs):
        return step
    return ScheduledStep(seqs=[step.seqs[k] for k in keep], num_new=[step.num_new[k] for k in keep])
