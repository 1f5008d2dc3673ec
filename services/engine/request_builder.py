"""Turning a prompt and its sampling parameters into validated Sequences, before anything is scheduled.

LLMEngine's half that checks a request (token ids, context length, max_tokens, priority) and builds
one Sequence per sample with its detokenizer, stop ids, RNG, logit bias and grammar state.
"""

from __future__ import annotations

import random
import secrets
import time

import torch
from kvrelay.engine import logits_processors
from kvrelay.engine.bad_words import BadWords, word_forms
from kvrelay.engine.block_pool import cache_root
from kvrelay.engine.detokenizer import IncrementalDetokenizer
from kvrelay.engine.errors import InvalidRequestError, PromptTooLongError
from kvrelay.engine.multimodal.inputs import prompt_images
from kvrelay.engine.outputs import RequestMetrics
from kvrelay.engine.pooling.params import check_pooling_request
from kvrelay.engine.sampler import to_device
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence
from kvrelay.engine.structured.mask import GrammarState


class RequestBuilderMixin:
    """Needs the engine's config, tokenizer, max_model_len, device, grammars, eos_ids, _next_seq_id, vision."""

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: must not be empty", field="prompt")
            return self.tokenizer.encode_prompt(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError(
                "prompt: must be a non-empty string or list of token ids", field="prompt"
            )
        vocab = self.config.vocab_size
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"prompt: token id {t!r} is not an integer in [0, {vocab})", field="prompt"
                )
        return list(prompt)

    def adapter_index(self, name: str | None) -> int:
        """The index of a LoRA adapter by name (-1 for None: the base model)."""
        if name is None:
            return -1
        adapters = getattr(self.model, "adapters", None)
        if adapters is None or name not in adapters.index:
            served = ", ".join(adapters.index) if adapters is not None and adapters.index else "none"
            raise InvalidRequestError(f"lora: no LoRA adapter {name!r} is loaded (loaded: {served})", field="model")
        return adapters.index[name]

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        hold_blocks: bool = False,
        cache_salt: str | None = None,
    ) -> list[Sequence]:
        """Validate and build the request's sequences; raises before anything is scheduled.

        hold_blocks (prefill side of a hand-off): keep the blocks after finishing until release().
        cache_salt: requests share cached prefix blocks only with requests of the same salt.
        """
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority: must be an integer, got {priority!r}", field="priority")
        params.validate(self.config.vocab_size)
        logits_processors.validate(params.logits_processors)
        check_pooling_request(params, self.pooler, self.config.hidden_size)
        ids = self.tokenize_prompt(prompt)
        images = prompt_images(self.vision, prompt, ids)  # its placeholders key the prefix cache by image
        limit = self.max_model_len
        if params.pooling is not None:  # an embedding: the prompt may fill the context, nothing is generated
            if len(ids) > limit:
                raise PromptTooLongError(f"input: {len(ids)} tokens, but the context holds {limit}",
                                         num_tokens=len(ids), limit=limit)
            params.max_tokens = 1
            if self.pooler.pooling_type != "LAST":  # every position is pooled: no prefix-cache hits
                cache_salt = f"{cache_salt or ''}\x00pooling:{secrets.token_hex(8)}"
        elif len(ids) >= limit:
            raise PromptTooLongError(
                f"prompt: {len(ids)} tokens, but the context holds {limit} tokens including at least one to "
                f"generate",
                num_tokens=len(ids),
                limit=limit - 1,
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit and params.pooling is None:
            raise InvalidRequestError(
                f"max_tokens: {max_tokens} new tokens plus {len(ids)} prompt tokens exceed the context of "
                f"{limit} tokens; ask for at most {limit - len(ids)}",
                field="max_tokens",
            )
        now = time.monotonic()
        bias = None
        # Built once here, not on every sampling step; copied without waiting for a step in flight.
        if params.logit_bias:
            bias = (to_device(list(params.logit_bias), self.device, torch.int64),
                    to_device(list(params.logit_bias.values()), self.device, torch.float32))
        if params.prompt_logprobs is not None:  # every position must be computed: no prefix-cache hits
            cache_salt = f"{cache_salt or ''}\x00prompt-logprobs:{secrets.token_hex(8)}"
        adapter = self.adapter_index(params.lora)
        root = cache_root(cache_salt, None if adapter < 0 else self.model.adapters.cache_keys[adapter])
        # A cache hit when the caller compiled off this thread first (AsyncEngine does).
        grammar = self.grammars.get(params.structured) if params.structured is not None else None
        # ignore_eos drops EOS only; explicit stop_token_ids still apply. A grammar's end is EOS (the
        # only token its mask then allows): constrained output always stops there.
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos and grammar is None else self.eos_ids)
        allowed = None if params.allowed_token_ids is None else to_device(
            sorted(set(params.allowed_token_ids)), self.device, torch.int64)
        forms = word_forms(self.tokenizer, params.bad_words) if params.bad_words else None
        ban_ids = None
        if params.min_tokens > 0 and stop_ids:
            ban_ids = to_device(sorted(stop_ids), self.device, torch.int64)
        seqs = []
        for index in range(params.n):
            seed = params.seed + index if params.seed is not None else secrets.randbits(62)
            seq = Sequence(
                seq_id=self._next_seq_id,
                request_id=request_id,
                index=index,
                token_ids=list(ids),
                prompt_len=len(ids),
                params=params,
                priority=priority,
                max_tokens=max_tokens,
                detok=IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens,
                                             params.include_stop_str_in_output),
                metrics=RequestMetrics(arrival_time=now),
                rng=None if params.greedy else random.Random(seed),
                wait_for=seqs[0] if seqs else None,
                hold_blocks=hold_blocks,
                cache_root=root,
                lora=adapter,
                stop_ids=stop_ids,
                ban_ids=ban_ids,
                allowed_ids=allowed,
                logit_bias=bias,
                adjusts_logits=params.repetition_penalty != 1.0 or bool(params.presence_penalty)
                or bool(params.frequency_penalty) or bias is not None or params.min_tokens > 0 or allowed is not None
                or bool(params.logits_processors) or forms is not None,
                processors=logits_processors.instantiate(params.logits_processors) + ([BadWords(forms)] if forms else []),
                grammar=None if grammar is None else GrammarState(
                    grammar.deep_copy(), self.tokenizer.vocab_size, params.structured.think_tokens,
                    params.structured.thinking),
                prompt_lps=[None] * (len(ids) - 1) if params.prompt_logprobs is not None and index == 0 else None,
                images=images,
            )
            self._next_seq_id += 1
            seqs.append(seq)
        return seqs
