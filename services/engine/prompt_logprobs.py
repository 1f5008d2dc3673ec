"""Prompt logprobs: the log-probability of each prompt token given the tokens before it.

The prefill chunks of a sequence that asks for them return a row of logits per position that
predicts a prompt token (model_runner.execute's prompt_rows). score_prompt turns them into the
chosen token's logprob and the top-k alternatives on the device; PromptScores.record writes them
into seq.prompt_lps once they are on the host. The request never takes prompt blocks from the
prefix cache (LLMEngine.make_request salts it alone), so every position is computed here once; a
position recomputed after preemption keeps its first result.

Scoring at launch and recording later lets async scheduling copy the scores back with the step's
tokens instead of waiting for the forward when the step is launched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvrelay.engine.outputs import TokenLogprob
from kvrelay.engine.sampler import to_device, to_host


@dataclass
class _Span:
    index: int  # in the step's seqs
    pos: int  # prompt position of the first row
    targets: list[int]  # the prompt tokens the rows predict
    chosen: torch.Tensor  # [rows] fp32
    top_vals: torch.Tensor | None  # [rows, k], best first; None when k == 0
    top_idx: torch.Tensor | None


@dataclass
class PromptScores:
    spans: list[_Span]

    def to_host(self, blocking: bool = True) -> PromptScores:
        return PromptScores([_Span(s.index, s.pos, s.targets, to_host(s.chosen, blocking), to_host(s.top_vals, blocking),
                                   to_host(s.top_idx, blocking)) for s in self.spans])

    def record(self, seqs: list) -> None:
        """Into each sequence's prompt_lps (a to_host copy; seqs: the step's sequences)."""
        for span in self.spans:
            seq = seqs[span.index]
            if seq.prompt_lps is None:  # already handed out with the first output
                continue
            chosen = span.chosen.tolist()
            vals = span.top_vals.tolist() if span.top_vals is not None else None
            idx = span.top_idx.tolist() if span.top_idx is not None else None
            for r, (token, value) in enumerate(zip(span.targets, chosen)):
                if seq.prompt_lps[span.pos + r] is not None:
                    continue
                top = list(zip(idx[r], vals[r])) if idx is not None else []
                seq.prompt_lps[span.pos + r] = TokenLogprob(token, value, top)


@torch.inference_mode()
def score_prompt(seqs: list, spans: list[tuple[int, int, torch.Tensor]]) -> PromptScores:
    """spans: (index in seqs, first position, fp32 logits [rows, vocab]) from one step; nothing
    here waits for the device."""
    out = []
    for i, pos, logits in spans:
        seq = seqs[i]
        if seq.prompt_lps is None:
            continue
        lps = torch.log_softmax(logits.float(), dim=-1)
        targets = seq.token_ids[pos + 1 : pos + 1 + lps.shape[0]]
        chosen = lps.gather(1, to_device(targets, lps.device, torch.int64)[:, None]).squeeze(1)
        k = seq.params.prompt_logprobs
        top_vals, top_idx = lps.topk(k, dim=-1) if k else (None, None)
        out.append(_Span(i, pos, targets, chosen, top_vals, top_idx))
    return PromptScores(out)


def record_prompt_logprobs(seqs: list, spans: list[tuple[int, int, torch.Tensor]]) -> None:
    """Score and record at once (the synchronous engine)."""
    score_prompt(seqs, spans).to_host().record(seqs)
