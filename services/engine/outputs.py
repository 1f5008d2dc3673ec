"""What the engine hands back: incremental outputs per request, and engine-wide stats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    # Top alternatives at this position, best first: (token_id, logprob).
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() when submitted
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """One increment of one sample (`index` < n) of a request.

    The async iterator of a request yields these until every sample has finished;
    the last one of each sample has `finish_reason` set.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    text: str  # text delta; never ends inside a UTF-8 character or a possible stop string
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    num_prompt_tokens: int
    num_generated_tokens: int  # cumulative for this sample
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    # prompt_logprobs: with the sample's first output, one entry per prompt token (None for the first).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A pooling engine's answer (kvrelay.engine.pooling): the prompt's vector, in its one, final output.
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    kv_blocks_total: int
    kv_blocks_free: int  # free now, counting evictable cached blocks as free
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # Speculative decoding (vLLM's spec_decode_* counters); zero when it is off.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    # ... of which for sequences with a grammar, and proposed tokens the grammar cut before verification.
    spec_num_constrained_drafts: int = 0
    spec_num_constrained_accepted_tokens: int = 0
    spec_num_grammar_cut_tokens: int = 0
    # Tensor/pipeline parallelism, as TP rank 0 of the last stage measured it; zero in one process.
    parallel_steps: int = 0
    parallel_step_seconds: float = 0.0
    parallel_comm_seconds: dict[str, float] = field(default_factory=dict)  # all_reduce, all_gather, send_recv
    parallel_comm_bytes: dict[str, int] = field(default_factory=dict)
    # Every rank's forward times and the per-step skew (parallel/rank_metrics.py: RankTimes, Histo).
    parallel_ranks: list[Any] = field(default_factory=list)
    parallel_skew: Any = None
    # Mixture-of-experts models: a callable returning kvrelay.engine.moe_layer.ExpertLoad, read at
    # scrape time only (on GPU it copies the device counters back). None for a dense model.
    expert_load: Callable[[], Any] | None = None
    # LoRA: requests running and waiting per adapter (every adapter served, zeros included); empty without.
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_waiting: dict[str, int] = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        return 0.0 if self.kv_blocks_total == 0 else 1.0 - self.kv_blocks_free / self.kv_blocks_total

    @property
    def prefix_hit_rate(self) -> float:
        return 0.0 if self.prefix_cache_queries == 0 else self.prefix_cache_hits / self.prefix_cache_queries
