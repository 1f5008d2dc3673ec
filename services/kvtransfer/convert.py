"""Engine dataclasses <-> kvrelay.v1 messages. Lossless for every field the wire carries."""

from __future__ import annotations

from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.outputs import RequestOutput, TokenLogprob
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.structured.spec import GuidedSpec
from kvrelay.v1 import common_pb2

_PLAIN = ("n", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
          "presence_penalty", "frequency_penalty", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
_OPTIONAL = ("max_tokens", "seed", "logprobs", "prompt_logprobs", "lora")


def params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    if p.logits_processors:  # the wire has no field for them yet: refuse rather than drop them
        raise InvalidRequestError("logits_processors: not supported across a prefill/decode hand-off yet",
                                  field="logits_processors")
    msg = common_pb2.SamplingParams(stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
                                    **{k: getattr(p, k) for k in _PLAIN})
    for k in _OPTIONAL:
        if getattr(p, k) is not None:
            setattr(msg, k, getattr(p, k))
    if p.logit_bias:
        msg.logit_bias.update(p.logit_bias)
    if p.allowed_token_ids:
        msg.allowed_token_ids.extend(p.allowed_token_ids)
    if p.bad_words:
        msg.bad_words.extend(p.bad_words)
    if p.structured is not None:
        s = p.structured
        msg.structured.CopyFrom(common_pb2.GuidedSpec(kind=s.kind, value=s.value, field=s.field,
                                                      think_tokens=list(s.think_tokens or ()), thinking=s.thinking))
    return msg


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    p = SamplingParams(**{k: getattr(msg, k) for k in _PLAIN})
    p.stop = list(msg.stop)
    p.stop_token_ids = list(msg.stop_token_ids)
    for k in _OPTIONAL:
        setattr(p, k, getattr(msg, k) if msg.HasField(k) else None)
    p.logit_bias = dict(msg.logit_bias) or None
    p.allowed_token_ids = list(msg.allowed_token_ids) or None
    p.bad_words = list(msg.bad_words) or None
    if msg.HasField("structured"):
        s = msg.structured
        p.structured = GuidedSpec(s.kind, s.value, s.field or "structured_outputs",
                                  tuple(s.think_tokens) if s.think_tokens else None, s.thinking)
    return p


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, [(t.token_id, t.logprob) for t in msg.top])


def add_prompt_logprobs(field, lps: list[TokenLogprob | None]) -> None:
    """Fill a repeated TokenLogprob field with prompt positions 1, 2, ... (position 0 has no
    logprob); positions never scored, only ever at the end (an output of a request aborted
    mid-prompt), are left off."""
    for lp in lps[1:]:
        if lp is None:
            break
        field.append(logprob_to_proto(lp))


def prompt_logprobs_from_proto(field, num_prompt_tokens: int) -> list[TokenLogprob | None]:
    """The engine's list again: None for position 0 and for every position not carried."""
    lps: list[TokenLogprob | None] = [None, *(logprob_from_proto(lp) for lp in field)]
    return lps + [None] * (num_prompt_tokens - len(lps))


def output_to_proto(out: RequestOutput, num_cached_tokens: int | None = None) -> common_pb2.RequestOutput:
    msg = common_pb2.RequestOutput(
        request_id=out.request_id, index=out.index, new_token_ids=out.new_token_ids, text=out.text,
        has_logprobs=out.logprobs is not None, finish_reason=out.finish_reason or "",
        num_prompt_tokens=out.num_prompt_tokens, num_generated_tokens=out.num_generated_tokens,
        num_cached_tokens=out.num_cached_tokens if num_cached_tokens is None else num_cached_tokens,
    )
    if out.logprobs:
        msg.logprobs.extend(logprob_to_proto(lp) for lp in out.logprobs)
    if out.prompt_logprobs is not None:
        msg.has_prompt_logprobs = True
        add_prompt_logprobs(msg.prompt_logprobs, out.prompt_logprobs)
    if isinstance(out.stop_reason, str):
        msg.stop_string = out.stop_reason
    elif isinstance(out.stop_reason, int):
        msg.stop_token_id = out.stop_reason
    return msg


def output_from_proto(msg: common_pb2.RequestOutput) -> RequestOutput:
    which = msg.WhichOneof("stop_reason")
    return RequestOutput(
        request_id=msg.request_id, index=msg.index, new_token_ids=list(msg.new_token_ids), text=msg.text,
        logprobs=[logprob_from_proto(lp) for lp in msg.logprobs] if msg.has_logprobs else None,
        finish_reason=msg.finish_reason or None,
        stop_reason=getattr(msg, which) if which else None,
        num_prompt_tokens=msg.num_prompt_tokens, num_generated_tokens=msg.num_generated_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        prompt_logprobs=prompt_logprobs_from_proto(msg.prompt_logprobs, msg.num_prompt_tokens)
        if msg.has_prompt_logprobs else None,
    )
