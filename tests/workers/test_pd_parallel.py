"""Prefill and decode workers whose engines run tensor/pipeline parallel worker processes: the
prefill driver gathers each chunk's K/V from its ranks and the decode driver scatters it to its
own, so even unequal sizes (prefill TP=2, decode PP=2) hand over and decode exactly as one
process does."""

from __future__ import annotations

import random

import pytest
from kvrelay.decode.worker import DecodeWorker
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.client import DecodeClient
from kvrelay.kvtransfer.worker_base import WorkerOptions, make_engine
from kvrelay.prefill.worker import PrefillWorker
from pd_helpers import assert_all_free

from kvrelay.models import BUNDLED_MODEL

PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_k=40, seed=1234, max_tokens=12, ignore_eos=True, logprobs=2),
}


async def _collect(stream):
    outs = [o async for o in stream]
    return [t for o in outs for t in o.new_token_ids], [lp.logprob for o in outs for lp in (o.logprobs or [])]


async def test_unequal_parallel_sizes_hand_over_and_match_one_process():
    opts = WorkerOptions(max_message_bytes=16 * 1024)  # many chunks per prompt
    args = {"model": str(BUNDLED_MODEL), "num_kv_blocks": 96}
    prefill = PrefillWorker(make_engine(EngineArgs(**args, tensor_parallel_size=2), opts), opts)
    decode = DecodeWorker(AsyncEngine(EngineArgs(**args, pipeline_parallel_size=2)), opts)
    ref = AsyncEngine(EngineArgs(**args))
    await ref.start()
    pport, dport = await prefill.start(), await decode.start()
    client = DecodeClient(f"127.0.0.1:{dport}")
    try:
        rng = random.Random(0)
        for n in (5, 40, 150):
            prompt = [rng.randrange(3, 512) for _ in range(n)]
            for kind, params in PARAMS.items():
                got = await _collect(client.generate(prompt, params, f"{n}-{kind}", prefill_addr=f"127.0.0.1:{pport}"))
                want = await _collect(ref.generate(prompt, params, f"{n}-{kind}"))
                assert got[0] == want[0], (n, kind)
                assert got[1] == pytest.approx(want[1], abs=1e-4), (n, kind)
        assert decode.metrics.kv_bytes._value.get() > 0
        await assert_all_free(prefill.engine, decode.engine)
    finally:
        await client.close()
        await prefill.stop(0)
        await decode.stop(0)
        await ref.shutdown()
