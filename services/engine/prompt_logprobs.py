"""Prompt logprobs: the log-probability of each prompt token given the tokens before it.

The prefill chunks of a sequence that asks for them return a row of logits per position that
predicts a prompt token (model_runner.execute's prompt_rows); each row becomes the token's
TokenLogprob (with its top-k alternatives). The request never takes prompt blocks from the prefix
cache (LLMEngine.make_request salts it alone), so every position is computed here once; a position
recomputed after preemption keeps its first result.
"""

from __future__ import annotations

import torch
from kvrelay.engine.outputs import TokenLogprob


@torch.inference_mode()
def record_prompt_logprobs(seqs: list, spans: list[tuple[int, int, torch.Tensor]]) -> None:
    """spans: (index in seqs, first position, fp32 logits [rows, vocab]) from one step."""
    for i, pos, logits in spans:
        seq = seqs[i]
        if seq.prompt_lps is None:
            continue
        lps = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(seq.token_ids[pos + 1 : pos + 1 + lps.shape[0]], dtype=torch.int64,
                               device=lps.device)
        chosen = lps.gather(1, targets[:, None]).squeeze(1).tolist()
        k = seq.params.prompt_logprobs
        top_vals, top_idx = lps.topk(k, dim=-1) if k else (None, None)
        for r, (token, value) in enumerate(zip(targets.tolist(), chosen)):
            if seq.prompt_lps[pos + r] is not None:
                continue
            top = list(zip(top_idx[r].tolist(), top_vals[r].tolist())) if k else []
            seq.prompt_lps[pos + r] = TokenLogprob(token, value, top)
