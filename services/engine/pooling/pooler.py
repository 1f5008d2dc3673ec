"""The vectors out of a step's hidden states, and the requests they finish.

In a pooling engine the model's last step for a prompt returns the final norm's output at the
prompt's last token, in place of the LM head's logits (DecoderModel.compute_logits). LAST pooling
uses that row alone. MEAN and CLS need the prompt's other rows: their chunks ask for every row
(model_runner.execute's prompt_rows, as prompt logprobs do) and accumulate() keeps a running sum,
or the first row, on the device until the last chunk. Such requests never take blocks from the
prefix cache (make_request salts them alone), so every position is computed here once.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from kvrelay.engine.outputs import RequestOutput
from kvrelay.engine.pooling.config import PoolerConfig


def wants_prompt_rows(cfg: PoolerConfig) -> bool:
    return cfg.pooling_type != "LAST"


def accumulate(cfg: PoolerConfig, seqs: list, spans: list[tuple[int, int, torch.Tensor]]) -> None:
    """spans: (index in seqs, first position, fp32 hidden rows) of the step's prompt chunks. A
    position computed again after preemption was counted already: it is skipped."""
    for i, pos, rows in spans:
        seq = seqs[i]
        skip = max(0, seq.pool_upto - pos)
        if skip >= rows.shape[0]:
            continue
        if cfg.pooling_type == "CLS":
            if pos == 0:
                seq.pool_acc = rows[0].clone()
        else:
            part = rows[skip:].sum(dim=0)
            seq.pool_acc = part if seq.pool_acc is None else seq.pool_acc + part
        seq.pool_upto = pos + rows.shape[0]


def finish_pooled(engine, seqs: list, last_rows: torch.Tensor) -> list[RequestOutput]:
    """Each sequence's vector from its last prompt token's row (and what accumulate() kept); the
    sequences finish with it."""
    cfg: PoolerConfig = engine.pooler
    vectors = []
    for k, seq in enumerate(seqs):
        row = last_rows[k]
        if cfg.pooling_type == "MEAN":
            row = (row if seq.pool_acc is None else seq.pool_acc + row) / seq.prompt_len
        elif cfg.pooling_type == "CLS" and seq.pool_acc is not None:  # None: a one-token prompt
            row = seq.pool_acc
        if cfg.task == "classify":  # the head's label logits: probabilities
            vectors.append(torch.softmax(row, dim=-1) if row.shape[0] > 1 else torch.sigmoid(row))
            continue
        params = seq.params.pooling
        if params.dimensions is not None:
            row = row[: params.dimensions]
        if cfg.normalize if params.normalize is None else params.normalize:
            row = F.normalize(row, p=2, dim=-1)
        vectors.append(row)
    host = torch.stack(vectors).cpu().tolist() if len({v.shape[0] for v in vectors}) == 1 else [
        v.cpu().tolist() for v in vectors]
    outputs, now = [], time.monotonic()
    for seq, vector in zip(seqs, host):
        seq.embedding, seq.pool_acc = vector, None
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        engine._finish(seq, "stop", None, now)
        outputs.append(engine._output(seq, [], ""))
    return outputs
