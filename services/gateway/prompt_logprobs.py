"""Prompt logprobs in OpenAI's and vLLM's shapes (evaluation harnesses score prompts with them).

- Completions with `echo` and `logprobs` (lm-evaluation-harness' loglikelihood requests, usually with
  `max_tokens: 0`): the choice's `logprobs` lists start with the prompt's tokens, the first of them
  with a `null` logprob, as OpenAI's legacy completions returned them.
- vLLM's `prompt_logprobs: k`: each choice gets `prompt_logprobs`, a list with `null` for the first
  prompt token, then per token a map token id -> {logprob, rank, decoded_token} holding the prompt
  token and the top-k alternatives.
"""

from __future__ import annotations


def echo_lists(token_text, prompt_ids: list[int], prompt_lps: list, k: int) -> dict:
    """The completions logprobs lists of the prompt (text_offset from 0)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for tid, lp in zip(prompt_ids, prompt_lps):
        token = token_text(tid)
        out["tokens"].append(token)
        out["token_logprobs"].append(None if lp is None else lp.logprob)
        out["top_logprobs"].append(None if lp is None else {token_text(t): v for t, v in lp.top[:k]})
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def vllm_lists(token_text, prompt_lps: list) -> list:
    out: list = []
    for lp in prompt_lps:
        if lp is None:  # the first prompt token has no logprob
            out.append(None)
            continue
        entry = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": token_text(t)} for r, (t, v) in
                 enumerate(lp.top)}
        if str(lp.token_id) not in entry:  # outside the top-k: its rank is not computed
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": None,
                                        "decoded_token": token_text(lp.token_id)}} | entry
        out.append(entry)
    return out
