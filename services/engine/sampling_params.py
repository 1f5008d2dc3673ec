"""Per-request sampling parameters, validated before anything is scheduled."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvrelay.engine.bad_words import MAX_WORD_CHARS as MAX_BAD_WORD_CHARS
from kvrelay.engine.bad_words import MAX_WORDS as MAX_BAD_WORDS
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.pooling.params import PoolingParams
from kvrelay.engine.structured.spec import KINDS, GuidedSpec

MAX_LOGPROBS = 20
MAX_N = 16
MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI allows


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: as many as the context allows
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: sampled token's logprob plus top-k alternatives
    prompt_logprobs: int | None = None  # None: off; k >= 0: each prompt token's logprob plus top-k (vLLM)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: the stop string, or stop token's text, ends the text
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these ids
    bad_words: list[str] | None = None  # vLLM's: words the output may not contain (kvrelay.engine.bad_words)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    # Plugin logits processors by name, with their arguments (kvrelay.engine.logits_processors).
    logits_processors: dict[str, dict] | None = None
    # Structured output: the grammar the output must follow (kvrelay.engine.structured).
    structured: GuidedSpec | None = None
    # The LoRA adapter (its --lora-modules name) that generates; None: the base model. Not sampling
    # proper, but it travels with the request everywhere these parameters do.
    lora: str | None = None
    # An embedding instead of tokens (a pooling engine's requests, kvrelay.engine.pooling); None: generate.
    pooling: PoolingParams | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field."""

        def bad(name: str, message: str) -> None:
            raise InvalidRequestError(f"{name}: {message}", field=name)

        def finite(name: str, value: float) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(name, f"must be a finite number, got {value!r}")

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            finite(name, getattr(self, name))
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if len(self.stop) > 16:
            bad("stop", f"at most 16 stop strings, got {len(self.stop)}")
        for name in ("skip_special_tokens", "include_stop_str_in_output", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"token ids must be < vocab size {vocab_size}")
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, list) or not allowed or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < (vocab_size or 2**31) for t in allowed)):
            bad("allowed_token_ids", "must be a non-empty list of token ids"
                + (f" below the vocab size {vocab_size}" if vocab_size else ""))
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if self.logit_bias is not None:
            self._validate_logit_bias(vocab_size, bad)
        if self.structured is not None and (not isinstance(self.structured, GuidedSpec)
                                            or self.structured.kind not in KINDS
                                            or not isinstance(self.structured.value, str)):
            bad("structured_outputs", f"must name one of {sorted(KINDS)} with a text value")
        think = None if self.structured is None else self.structured.think_tokens
        if think is not None and (len(think) != 2 or not all(
                isinstance(t, int) and 0 <= t < (vocab_size or 2**31) for t in think)):
            bad("structured_outputs", f"think tokens must be two token ids below the vocab size, got {think!r}")
        if self.bad_words is not None and (
                not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS
                or not all(isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words)):
            bad("bad_words", f"must be a list of at most {MAX_BAD_WORDS} non-blank words of at most "
                             f"{MAX_BAD_WORD_CHARS} characters")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            bad("lora", f"must be an adapter's name, got {self.lora!r}")
        if self.pooling is not None:
            if not isinstance(self.pooling, PoolingParams):
                bad("pooling", "must be a PoolingParams")
            self.pooling.validate()

    def _validate_logit_bias(self, vocab_size: int | None, bad) -> None:
        bias = self.logit_bias
        if not isinstance(bias, dict):
            bad("logit_bias", "must map token ids to biases")
        if len(bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                bad("logit_bias", f"keys must be token ids (non-negative integers), got {token!r}")
            if vocab_size is not None and token >= vocab_size:
                bad("logit_bias", f"token id {token} is not below the vocab size {vocab_size}")
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or not -100.0 <= value <= 100.0):
                bad("logit_bias", f"bias of token {token} must be a number in [-100, 100], got {value!r}")


def defaults_from_generation_config(generation_config: dict) -> SamplingParams:
    """Default sampling params from a model's generation_config.json (do_sample false: greedy)."""
    params = SamplingParams()
    for key in ("temperature", "top_p", "top_k", "repetition_penalty"):
        if key in generation_config:
            setattr(params, key, generation_config[key])
    if generation_config.get("do_sample") is False:
        params.temperature = 0.0
    return params
