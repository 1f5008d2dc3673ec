"""Speculative decoding in the engine's step: proposals before the forward, verification after.

Per step, each running decode may get up to K proposed tokens. They are appended to its token ids
for the step only, so the input builder packs [last token, proposals...] as one extend chunk and
the target scores every position in the same forward (the paged prefill attention is causal over
the cache). After the forward the proposals are removed again, verified (verify.py), and only the
emitted tokens enter the sequence; K/V written for rejected positions lie beyond num_computed and
are overwritten later, and no block is registered in the prefix cache past num_computed.

Backoff: no speculation when more than `disable_batch_size` sequences run (a full batch is
compute-bound: verifying K extra tokens per sequence would slow it), for sequences with penalties
(their logits depend on every earlier token), and per sequence after
proposals keep being rejected (K halves after a step that accepted nothing, down to a rest of
COOL_DOWN_STEPS steps without proposals, and grows back by one per accepted step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.engine.scheduler import ScheduledStep, Scheduler
from kvrelay.engine.sequence import Sequence
from kvrelay.engine.spec_decode.ngram import NgramProposer
from kvrelay.engine.spec_decode.verify import speculates

METHODS = ("ngram",)
COOL_DOWN_STEPS = 8  # steps a sequence proposes nothing after proposals of one token kept failing


@dataclass
class SpecConfig:
    method: str
    num_tokens: int  # K
    ngram_min: int = 2
    ngram_max: int = 4
    disable_batch_size: int = 32


@dataclass
class SpecStats:
    """Counters named as vLLM names them (kvrelay:spec_decode_*)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpecConfig, scheduler: Scheduler, max_num_batched_tokens: int):
        if config.method not in METHODS:
            raise ValueError(f"--speculative-method must be one of {', '.join(METHODS)}, got {config.method!r}")
        if not 1 <= config.num_tokens <= 16:
            raise ValueError(f"--num-speculative-tokens must be between 1 and 16, got {config.num_tokens}")
        self.config = config
        self.scheduler = scheduler
        self.budget = max_num_batched_tokens
        self.proposer = NgramProposer(config.ngram_min, config.ngram_max)
        self.stats = SpecStats(accepted_per_position=[0] * config.num_tokens)
        self._k: dict[Sequence, int] = {}  # per-sequence K after backoff

    def propose(self, step: ScheduledStep) -> dict[int, tuple[list[int], int]]:
        """Extend eligible decodes of step with proposals (in place: token ids and num_new). Returns
        {index in step.seqs: (proposal, num_computed before the step)}."""
        if len(step.seqs) > self.config.disable_batch_size:
            return {}
        room = self.budget - sum(step.num_new)
        out = {}
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_new)):
            if room <= 0:
                break
            if n != 1 or seq.num_computed + 1 != seq.num_tokens or not speculates(seq):
                continue  # a prefill chunk, or a sequence whose sampler depends on its history
            generated = seq.num_generated
            k = self._k.get(seq, self.config.num_tokens)
            if k <= 0:  # resting after rejections
                self._k[seq] = k + 1 if k < -1 else 1
                continue
            k = min(k, seq.max_tokens - generated - 1, room)
            proposal = self.proposer.propose(seq.token_ids, k) if k > 0 else []
            if not proposal or not self.scheduler.try_allocate(seq, 1 + len(proposal)):
                continue
            out[i] = (proposal, seq.num_computed)
            seq.token_ids.extend(proposal)
            step.num_new[i] = 1 + len(proposal)
            room -= len(proposal)
        return out

    def withdraw(self, step: ScheduledStep, proposals: dict[int, tuple[list[int], int]]) -> None:
        """Take the proposals out of the token ids again (right after the forward)."""
        for i, (proposal, _) in proposals.items():
            del step.seqs[i].token_ids[-len(proposal) :]

    def record(self, seq: Sequence, proposal: list[int], emitted: list[int]) -> None:
        accepted = len(emitted) - 1
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += len(proposal)
        s.num_accepted_tokens += accepted
        for pos in range(accepted):
            s.accepted_per_position[pos] += 1
        k = self._k.get(seq, self.config.num_tokens)
        # Halve K after a step that accepted nothing; at zero the sequence rests (negative K counts
        # the steps it waits before trying one token again); grow K back by one per success.
        self._k[seq] = (k // 2 if k > 1 else -COOL_DOWN_STEPS) if accepted == 0 else min(self.config.num_tokens, k + 1)
        if len(self._k) > 4 * self.budget:  # forget finished sequences now and then
            self._k = {s: v for s, v in self._k.items() if not s.finished}
