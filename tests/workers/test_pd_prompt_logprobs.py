"""Prompt logprobs across the prefill/decode hand-off: the prefill worker scores the prompt, the
scores travel in PrefillDone (inline gRPC and shared-memory planes) and leave the decode worker
with the first output, equal to the single-process engine's; the message limit is checked before
anything is computed; a prefill worker that sends none costs a local prefill, not a wrong answer."""

from __future__ import annotations

import dataclasses
import random

import pytest
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.outputs import RequestOutput, TokenLogprob
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.client import DecodeClient
from kvrelay.kvtransfer.convert import output_from_proto, output_to_proto, params_from_proto, params_to_proto
from kvrelay.kvtransfer.prompt_logprobs_wire import prompt_logprobs_bound, received_prompt_logprobs
from kvrelay.kvtransfer.worker_base import WorkerOptions
from kvrelay.v1 import kv_pb2
from pd_helpers import assert_all_free, start_pair, stop_pair

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
SEEDED = SamplingParams(temperature=0.9, seed=11, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=0)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    base = [rng.randrange(3, 512) for _ in range(300)]
    return [base[:1], base[:5], base[:16], base[:300], base[:200] + [9, 9, 9]]


def _assert_same(got: list[RequestOutput], want: list[RequestOutput]) -> None:
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    assert [o.prompt_logprobs is None for o in got] == [o.prompt_logprobs is None for o in want]
    g, w = got[0].prompt_logprobs, want[0].prompt_logprobs
    assert g[0] is None and w[0] is None and len(g) == len(w)
    for a, b in zip(g[1:], w[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= 1e-5
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(abs(x - y) <= 1e-5 for (_, x), (_, y) in zip(a.top, b.top))
    assert got[0].num_cached_tokens == want[0].num_cached_tokens == 0  # every position computed


async def _pair(plane: str, tmp_path, **decode_kw):
    opts = WorkerOptions(max_message_bytes=64 * 1024)
    dopts = dataclasses.replace(opts, **decode_kw)
    if plane == "shm":
        dopts = dataclasses.replace(dopts, kv_shm_bytes=4 << 20, kv_shm_dir=str(tmp_path))
    return await start_pair(prefill_options=opts, decode_options=dopts)


@pytest.mark.parametrize("plane", ["grpc", "shm"])
async def test_prompt_logprobs_equal_the_single_process(plane, tmp_path):
    pair = await _pair(plane, tmp_path)
    ref = AsyncEngine(EngineArgs(num_kv_blocks=96))
    await ref.start()
    try:
        prompts = _prompts()
        # Warm both workers' prefix caches with the last prompt's shared prefix: scoring it must
        # still compute (and return) every position.
        plain = dataclasses.replace(GREEDY, prompt_logprobs=None)
        async for _ in pair.client.generate(prompts[3], plain, prefill_addr=pair.prefill_addr):
            pass
        connected = pair.prefill.metrics.doorbells.labels("connected")._value.get()
        for prompt in [*prompts, prompts[3]]:  # the repeat finds its blocks in the decode worker's cache
            for params in (GREEDY, SEEDED):
                got = [o async for o in pair.client.generate(prompt, params, prefill_addr=pair.prefill_addr)]
                want = [o async for o in ref.generate(prompt, params)]
                _assert_same(got, want)
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 0  # all scored on the prefill side
        assert pair.decode.metrics.kv_plane_bytes.labels(plane)._value.get() > 0
        if plane == "shm":  # scoring hand-offs leave the doorbell for the stream; a plain one still rings
            assert pair.prefill.metrics.doorbells.labels("connected")._value.get() == connected > 0
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)
        await ref.shutdown()


async def test_over_the_message_limit_is_refused_before_any_compute(tmp_path):
    prompt = list(range(10, 110))  # 99 scored positions x 21 entries: up to 35 KB
    many = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=20)
    # The decode worker's limit (its reply to the client carries them).
    pair = await _pair("grpc", tmp_path, max_message_bytes=16 * 1024)
    try:
        with pytest.raises(InvalidRequestError, match="decode worker -> client") as e:
            async for _ in pair.client.generate(prompt, many, prefill_addr=pair.prefill_addr):
                pass
        assert e.value.field == "prompt_logprobs"
        assert pair.prefill.engine.stats().prompt_tokens_total == 0
        assert pair.decode.engine.stats().prompt_tokens_total == 0
        # The client's own limit, checked before the call.
        async with DecodeClient(pair.decode_addr, max_message_bytes=16 * 1024) as small:
            with pytest.raises(InvalidRequestError, match="prompt_logprobs: 100 prompt tokens"):
                async for _ in small.generate(prompt, many, prefill_addr=pair.prefill_addr):
                    pass
        # Within the limit, the same request is served.
        few = dataclasses.replace(many, prompt_logprobs=1)
        outs = [o async for o in pair.client.generate(prompt, few, prefill_addr=pair.prefill_addr)]
        assert len(outs[0].prompt_logprobs) == len(prompt)
    finally:
        await stop_pair(pair)
    # The prefill worker's smaller limit: its refusal reaches the client with the field named.
    pair = await start_pair(prefill_options=WorkerOptions(max_message_bytes=16 * 1024))
    try:
        with pytest.raises(InvalidRequestError, match="prefill -> decode") as e:
            async for _ in pair.client.generate(prompt, many, prefill_addr=pair.prefill_addr):
                pass
        assert e.value.field == "prompt_logprobs"
        assert pair.prefill.engine.stats().prompt_tokens_total == 0
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


async def test_prefill_worker_that_sends_none_costs_a_local_prefill(monkeypatch, tmp_path):
    """A prefill worker that leaves them out (e.g. an older version) fails the attempt; the decode
    worker scores the prompt itself, so the answer is still complete and right."""
    from kvrelay.prefill.sender import HandoffSender

    original = HandoffSender._done_message

    def without_prompt_logprobs(self, h, out):
        done = original(self, h, out)
        done.ClearField("prompt_logprobs")
        done.has_prompt_logprobs = False
        return done

    monkeypatch.setattr(HandoffSender, "_done_message", without_prompt_logprobs)
    pair = await _pair("grpc", tmp_path)
    ref = AsyncEngine(EngineArgs(num_kv_blocks=96))
    await ref.start()
    try:
        prompt = _prompts()[3]
        got = [o async for o in pair.client.generate(prompt, GREEDY, prefill_addr=pair.prefill_addr)]
        _assert_same(got, [o async for o in ref.generate(prompt, GREEDY)])
        assert pair.decode.metrics.failures.labels("PrefillFailedError")._value.get() == 1
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 1
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)
        await ref.shutdown()


def test_wire_round_trip_and_checks():
    lps = [None, TokenLogprob(5, -1.25, [(7, -0.5), (5, -1.25)]), TokenLogprob(6, -3.0, []), None, None]
    out = RequestOutput("r", 0, [9], "x", None, None, None, num_prompt_tokens=5, num_generated_tokens=1,
                        prompt_logprobs=lps)
    assert output_from_proto(output_to_proto(out)).prompt_logprobs == lps  # unscored tail kept as None
    one = dataclasses.replace(out, num_prompt_tokens=1, prompt_logprobs=[None])
    assert output_from_proto(output_to_proto(one)).prompt_logprobs == [None]
    assert output_from_proto(output_to_proto(dataclasses.replace(out, prompt_logprobs=None))).prompt_logprobs is None
    for k in (None, 0, 20):
        assert params_from_proto(params_to_proto(SamplingParams(prompt_logprobs=k))).prompt_logprobs == k

    # The bound holds for the largest entries the wire can carry.
    k, n = 20, 50
    worst = kv_pb2.PrefillDone()
    for _ in range(n - 1):
        worst.prompt_logprobs.add(token_id=2**32 - 1, logprob=-1e-300,
                                  top=[{"token_id": 2**32 - 1, "logprob": -1e-300}] * k)
    assert worst.ByteSize() <= prompt_logprobs_bound(n, k) < 1.01 * worst.ByteSize()

    done = kv_pb2.PrefillDone(has_prompt_logprobs=True)
    done.prompt_logprobs.add(token_id=5, logprob=-1.0, top=[{"token_id": 5, "logprob": -1.0}])
    assert received_prompt_logprobs(done, [1, 5], 1) == [None, TokenLogprob(5, -1.0, [(5, -1.0)])]
    assert received_prompt_logprobs(done, [1, 5], None) is None
    for ids, k, why in (([1, 6], 1, "position 1"), ([1, 5, 6], 1, "sent 1 prompt logprobs"),
                        ([1, 5], 0, "position 1")):
        with pytest.raises(ValueError, match=why):
            received_prompt_logprobs(done, ids, k)
    with pytest.raises(ValueError, match="no prompt logprobs"):
        received_prompt_logprobs(kv_pb2.PrefillDone(), [1, 5], 1)
