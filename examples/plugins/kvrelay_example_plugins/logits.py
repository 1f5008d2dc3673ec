"""ban_tokens: never sample the given token ids. Request it with
`extra_body={"logits_processors": {"ban_tokens": {"token_ids": [5, 7]}}}`."""

from __future__ import annotations

import torch

MAX_BANNED = 256


class BanTokens:
    @staticmethod
    def validate(args: dict) -> None:
        ids = args.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError("token_ids must be a non-empty list of token ids")
        if len(ids) > MAX_BANNED:
            raise ValueError(f"at most {MAX_BANNED} token_ids")
        if set(args) - {"token_ids"}:
            raise ValueError(f"unknown arguments {sorted(set(args) - {'token_ids'})}")

    def __init__(self, args: dict):
        self.ids = torch.tensor(args["token_ids"], dtype=torch.int64)

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> None:
        ids = self.ids[self.ids < logits.shape[0]].to(logits.device)
        logits[ids] = float("-inf")
