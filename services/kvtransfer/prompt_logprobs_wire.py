"""Prompt logprobs across the prefill/decode hand-off.

A request that asks for them (vLLM's `prompt_logprobs: k`, or completions' `echo` with
`logprobs`) is scored where its prompt is computed: on the prefill worker, whose engine fills them
in as for any request (kvrelay.engine.prompt_logprobs). They travel in `PrefillDone` to the decode
worker, which hands them out with the request's first output (`RequestOutput.prompt_logprobs` on
`DecodeService.Generate`), and the gateway shapes them as it does in one process.

Each hop carries all of them in one message, (prompt tokens - 1) x (k + 1) entries, so each hop
checks up front, before anything is computed, that the worst case fits its message limit
(`--max-message-bytes`): a clear 400 naming `prompt_logprobs` instead of a broken stream.
"""

from __future__ import annotations

from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.outputs import TokenLogprob
from kvrelay.kvtransfer.convert import prompt_logprobs_from_proto

# Worst-case protobuf bytes, each field present: a TopLogprob is tag + length + (tag + 5-byte
# varint token id) + (tag + 8-byte double) = 17; a TokenLogprob adds tag + 3-byte length + token id
# and logprob (15) = 19 to its k TopLogprobs.
_TOP_BYTES = 17
_ENTRY_BYTES = 19

PREFILL_HOP = "prefill -> decode worker hop (--max-message-bytes of both workers)"
DECODE_HOP = "decode worker -> client hop (the decode worker's --max-message-bytes, the client's channel limit)"


def prompt_logprobs_bound(num_prompt_tokens: int, k: int) -> int:
    """Upper bound on the serialised size of one request's prompt logprobs."""
    return max(0, num_prompt_tokens - 1) * (_ENTRY_BYTES + k * _TOP_BYTES)


def check_prompt_logprobs_fit(num_prompt_tokens: int, k: int, max_message_bytes: int, hop: str) -> None:
    """Raise InvalidRequestError (a 400 naming prompt_logprobs) if they might not fit one message
    of the hop: PREFILL_HOP or DECODE_HOP."""
    need = prompt_logprobs_bound(num_prompt_tokens, k)
    if need > max_message_bytes:
        raise InvalidRequestError(
            f"prompt_logprobs: {num_prompt_tokens} prompt tokens with {k} alternatives each need up to {need} B, "
            f"over the {max_message_bytes} B message limit of the {hop}; ask for fewer alternatives or send a "
            f"shorter prompt", field="prompt_logprobs")


def received_prompt_logprobs(done, prompt_ids: list[int], k: int | None) -> list[TokenLogprob | None] | None:
    """PrefillDone's prompt logprobs (None when not asked for), checked: one per position after the
    first, each for the prompt's own token, with at most k alternatives. Raises ValueError if not."""
    if k is None:
        return None
    if not done.has_prompt_logprobs:
        raise ValueError("the prefill worker sent no prompt logprobs (a version without them?)")
    entries = done.prompt_logprobs
    if len(entries) != len(prompt_ids) - 1:
        raise ValueError(f"the prefill worker sent {len(entries)} prompt logprobs for {len(prompt_ids)} prompt "
                         f"tokens (expected {len(prompt_ids) - 1})")
    for pos, (entry, token) in enumerate(zip(entries, prompt_ids[1:]), start=1):
        if entry.token_id != token or len(entry.top) > k:
            raise ValueError(f"the prefill worker's prompt logprob at position {pos} is for token "
                             f"{entry.token_id} with {len(entry.top)} alternatives; the prompt has {token} there "
                             f"and {k} were asked for")
    return prompt_logprobs_from_proto(entries, len(prompt_ids))
