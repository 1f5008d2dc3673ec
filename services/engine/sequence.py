"""A sequence: one sample of one request, with its tokens, blocks and progress."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from kvrelay.engine.detokenizer import IncrementalDetokenizer
from kvrelay.engine.outputs import RequestMetrics, TokenLogprob
from kvrelay.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RESERVED = "reserved"  # decode side: blocks allocated, K/V arriving from a prefill worker
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int  # engine-wide arrival order; FCFS and "newest first" preemption use it
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt followed by generated tokens
    prompt_len: int
    params: SamplingParams
    priority: int
    max_tokens: int  # resolved: never runs past the context
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    rng: random.Random | None = None  # sampled (not greedy) sequences: one uniform per token
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)  # only ever appended to, or replaced after
    table_epoch: int = 0  # bumped when the blocks are freed (the model runner's cached row is stale)
    # Leading block_table entries freed as out of the sliding window: their ids stay (stale, never
    # read by the kernels), so the table is still only appended to.
    num_dropped: int = 0
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_hashes: list[int] = field(default_factory=list)  # keys of full blocks, computed lazily
    cache_root: int = 0  # parent key of the first block: block_pool.cache_root(the request's salt)
    lora: int = -1  # index of its LoRA adapter in the engine's LoRASet; -1: the base model
    num_registered: int = 0  # leading blocks registered in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    first_admitted: bool = False
    # Samples 1..n-1 wait until sample 0 has computed the prompt, then reuse its cached blocks.
    wait_for: Sequence | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Blocks stay allocated after finishing until release() (prefill side of P/D hand-off).
    hold_blocks: bool = False
    # Token ids that finish the sequence (EOS unless ignore_eos, plus stop_token_ids).
    stop_ids: frozenset[int] = frozenset()
    # params.logit_bias as (token ids, biases) tensors on the engine's device; None when unset.
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None
    # stop_ids on the engine's device, for the min_tokens ban; None without min_tokens.
    ban_ids: torch.Tensor | None = None
    # params.allowed_token_ids, sorted and distinct, on the engine's device: every other token is out.
    allowed_ids: torch.Tensor | None = None
    # Penalties, logit bias, allowed ids or a min_tokens ban apply: the sampler edits this row first.
    adjusts_logits: bool = False
    # Instances of the request's plugin logits processors, applied to this sequence's rows.
    processors: list = field(default_factory=list)
    # Structured output: the grammar's matcher (kvrelay.engine.structured.mask.GrammarState).
    grammar: object | None = None
    # The prompt's distinct ids as a sorted int32 array, made once for the penalties (sampler.penalties_of).
    prompt_array: np.ndarray | None = None
    # Prompt logprobs (sample 0 only): entry p is prompt token p + 1's, filled as chunks compute;
    # handed out with the first output, then None.
    prompt_lps: list | None = None
    # Pooling engines (kvrelay.engine.pooling): the MEAN sum or CLS row so far, the prompt positions
    # it covers, and the finished vector.
    pool_acc: torch.Tensor | None = None
    pool_upto: int = 0
    embedding: list[float] | None = None
    # Vision-language models: the prompt's images (kvrelay.engine.multimodal.inputs.SequenceImages).
    images: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def blocked(self) -> bool:
        w = self.wait_for
        if w is None:
            return False
        if w.finished or w.num_computed >= w.prompt_len or w.status is Status.WAITING and w.first_admitted:
            self.wait_for = None
            return False
        return True
