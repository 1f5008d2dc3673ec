"""Speculative decoding in the engine's step: proposals before the forward, verification after.

Per step, each running decode may get up to K proposed tokens. They are appended to its token ids
for the step only, so the input builder packs [last token, proposals...] as one extend chunk and
the target scores every position in the same forward (the paged prefill attention is causal over
the cache). After the forward the proposals are removed again, verified (verify.py), and only the
emitted tokens enter the sequence; K/V written for rejected positions lie beyond num_computed and
are overwritten later, and no block is registered in the prefix cache past num_computed.

Backoff, per step: no speculation when more than `disable_batch_size` sequences run, and in
steps where the throughput controller (controller.py) has measured plain decoding to be faster at
this batch size. Per sequence: none with penalties (their logits depend on every earlier token),
and less after proposals keep being rejected (K halves after a step that accepted nothing, down to
a rest of COOL_DOWN_STEPS steps without proposals, and grows back by one per accepted step).
Seeded sampled sequences follow only their own backoff, never the batch-level decisions: whether a
step speculates changes how many uniforms their random stream gives up, so a batch-level decision
would make their tokens depend on the rest of the batch (their proposals also get the token budget
first; a budget smaller than the batch's proposals is the one case where that still can).

Constrained sequences (structured output) speculate too: their proposals are cut to the longest
prefix their grammar accepts (llguidance validates it without advancing the matcher), the draft
model masks its own proposals with a fork of the matcher (draft.py), and verify.py masks every row
the target scored with a fork advanced through the proposals before it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvrelay.engine.scheduler import ScheduledStep, Scheduler
from kvrelay.engine.sequence import Sequence
from kvrelay.engine.spec_decode.controller import SpecController
from kvrelay.engine.spec_decode.draft import DraftModel
from kvrelay.engine.spec_decode.ngram import NgramProposer
from kvrelay.engine.spec_decode.verify import speculates

METHODS = ("ngram", "draft")
COOL_DOWN_STEPS = 8  # steps a sequence proposes nothing after proposals of one token kept failing


@dataclass
class SpecConfig:
    method: str
    num_tokens: int  # K
    ngram_min: int = 2
    ngram_max: int = 4
    disable_batch_size: int = 32
    model: str | None = None  # the draft model's folder (method "draft")
    adaptive: bool = True  # the throughput controller may turn speculation off per step


@dataclass
class SpecStats:
    """Counters named as vLLM names them (kvrelay:spec_decode_*)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # Of the above, for sequences with a grammar; and the proposed tokens the grammar cut off.
    num_constrained_drafts: int = 0
    num_constrained_accepted_tokens: int = 0
    num_grammar_cut_tokens: int = 0


def _seeded(seq: Sequence) -> bool:
    return seq.rng is not None and seq.params.seed is not None


def check_config(config: SpecConfig) -> None:
    """The flags' errors, raised at start before any model loads."""
    if config.method not in METHODS:
        raise ValueError(f"--speculative-method must be one of {', '.join(METHODS)}, got {config.method!r}")
    if not 1 <= config.num_tokens <= 16:
        raise ValueError(f"--num-speculative-tokens must be between 1 and 16, got {config.num_tokens}")
    if config.method == "draft" and not config.model:
        raise ValueError("--speculative-method draft needs --speculative-model DIR (a smaller model with the "
                         "target's tokenizer)")
    if config.method != "draft" and config.model:
        raise ValueError("--speculative-model is used by --speculative-method draft only")


class Speculator:
    def __init__(self, config: SpecConfig, scheduler: Scheduler, max_num_batched_tokens: int,
                 draft: DraftModel | None = None):
        check_config(config)
        if (config.method == "draft") != (draft is not None):
            raise ValueError("the draft method runs with a DraftModel, and only it")
        self.config = config
        self.draft = draft
        self.scheduler = scheduler
        self.budget = max_num_batched_tokens
        self.proposer = NgramProposer(config.ngram_min, config.ngram_max)
        self.stats = SpecStats(accepted_per_position=[0] * config.num_tokens)
        self._k: dict[Sequence, int] = {}  # per-sequence K after backoff
        self.controller = SpecController()
        self._measuring: tuple[int, bool, float] | None = None

    def propose(self, step: ScheduledStep) -> dict[int, tuple[list[int], int]]:
        """Extend eligible decodes of step with proposals (in place: token ids and num_new). Returns
        {index in step.seqs: (proposal, num_computed before the step)}."""
        batch = len(step.seqs)
        decode_only = all(n == 1 for n in step.num_new)
        if batch > self.config.disable_batch_size:
            on = False
        elif not self.config.adaptive:
            on = True
        elif decode_only:  # the steps the controller measures
            on = self.controller.should_speculate(batch)
        else:
            on = self.controller.preferred(batch)
        start = time.perf_counter()
        room = self.budget - sum(step.num_new)
        out = {}
        drafting: list[tuple[int, int]] = []  # (index in step.seqs, K) waiting for the draft model
        # Seeded sampled sequences first, and whatever the batch-level decision: how many uniforms
        # their random stream gives up depends on whether they speculate, so only their own history
        # may decide it (their tokens then do not depend on the rest of the batch).
        order = sorted(range(batch), key=lambda i: not _seeded(step.seqs[i]))
        for i in order:
            seq, n = step.seqs[i], step.num_new[i]
            if room <= 0:
                break
            if n != 1 or seq.num_computed + 1 != seq.num_tokens or not speculates(seq):
                continue  # a prefill chunk, or a sequence whose sampler depends on its history
            if not on and not _seeded(seq):
                continue
            k = self._k.get(seq, self.config.num_tokens)
            if k <= 0:  # resting after rejections
                self._k[seq] = k + 1 if k < -1 else 1
                continue
            k = min(k, seq.max_tokens - seq.num_generated - 1, room)
            if k <= 0:
                continue
            if seq.grammar is not None:
                seq.grammar.sync(seq.output_ids)
            if self.draft is not None:  # slots first: the draft writes its K/V into the same blocks
                if seq.grammar is not None and seq.grammar.matcher.is_stopped():
                    continue  # the grammar is complete: only EOS can follow, nothing to draft
                if self.scheduler.try_allocate(seq, 1 + k):
                    drafting.append((i, k))
                    room -= k
                continue
            proposal = self._cut(seq, self.proposer.propose(seq.token_ids, k))
            if proposal and self.scheduler.try_allocate(seq, 1 + len(proposal)):
                out[i] = proposal
                room -= len(proposal)
        if drafting:
            drafts = self.draft.propose([step.seqs[i] for i, _ in drafting], [k for _, k in drafting])
            for (i, _), drafted in zip(drafting, drafts):
                seq = step.seqs[i]
                proposal = self._cut(seq, drafted)
                if proposal:
                    out[i] = proposal
                elif drafted:  # all cut: the draft's K/V is valid up to the last real token only
                    self.draft.rollback(seq, seq.num_tokens)
        # Measured as a speculative step only when it carried proposals.
        self._measuring = (batch, bool(out), start) if decode_only and self.config.adaptive else None
        for i, proposal in out.items():
            seq = step.seqs[i]
            out[i] = (proposal, seq.num_computed)
            seq.token_ids.extend(proposal)
            step.num_new[i] = 1 + len(proposal)
        return out

    def may_propose(self, step: ScheduledStep) -> bool:
        """Whether propose() could act on step (propose, or count a sequence's rest down): a decode
        that speculates, in a batch small enough to speculate or seeded (seeded sequences follow
        their own backoff whatever the batch). Async scheduling runs such steps synchronously:
        proposals need every token on the host."""
        small = len(step.seqs) <= self.config.disable_batch_size
        return any(n == 1 and speculates(seq) and (small or _seeded(seq)) for seq, n in zip(step.seqs, step.num_new))

    def _cut(self, seq: Sequence, proposal: list[int]) -> list[int]:
        """The longest prefix of proposal that seq's grammar accepts (all of it without one)."""
        if seq.grammar is None or not proposal:
            return proposal
        n = seq.grammar.valid_prefix(proposal)
        self.stats.num_grammar_cut_tokens += len(proposal) - n
        return proposal[:n]

    def finish_step(self, tokens: int) -> None:
        """The step that propose() began emitted `tokens` tokens: feed the controller."""
        if self._measuring is not None:
            batch, on, start = self._measuring
            self.controller.record(batch, on, tokens, time.perf_counter() - start)
            self._measuring = None

    def withdraw(self, step: ScheduledStep, proposals: dict[int, tuple[list[int], int]]) -> None:
        """Take the proposals out of the token ids again (right after the forward)."""
        for i, (proposal, _) in proposals.items():
            del step.seqs[i].token_ids[-len(proposal) :]

    def record(self, seq: Sequence, proposal: list[int], emitted: list[int], computed_before: int) -> None:
        accepted = len(emitted) - 1
        if self.draft is not None:  # its K/V stays valid up to the last accepted proposal it fed
            self.draft.rollback(seq, computed_before + 1 + min(accepted, len(proposal) - 1))
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += len(proposal)
        s.num_accepted_tokens += accepted
        for pos in range(accepted):
            s.accepted_per_position[pos] += 1
        if seq.grammar is not None:
            s.num_constrained_drafts += 1
            s.num_constrained_accepted_tokens += accepted
        k = self._k.get(seq, self.config.num_tokens)
        # Halve K after a step that accepted nothing; at zero the sequence rests (negative K counts
        # the steps it waits before trying one token again); grow K back by one per success.
        self._k[seq] = (k // 2 if k > 1 else -COOL_DOWN_STEPS) if accepted == 0 else min(self.config.num_tokens, k + 1)
        if len(self._k) > 4 * self.budget:  # forget finished sequences now and then
            self._k = {s: v for s, v in self._k.items() if not s.finished}

    def engine_stats(self) -> dict:
        """The counters as EngineStats fields (vLLM's spec_decode_* metrics)."""
        s = self.stats
        return {"spec_num_drafts": s.num_drafts, "spec_num_draft_tokens": s.num_draft_tokens,
                "spec_num_accepted_tokens": s.num_accepted_tokens,
                "spec_accepted_per_position": list(s.accepted_per_position),
                "spec_num_constrained_drafts": s.num_constrained_drafts,
                "spec_num_constrained_accepted_tokens": s.num_constrained_accepted_tokens,
                "spec_num_grammar_cut_tokens": s.num_grammar_cut_tokens}
