"""A decode worker that speculates (n-gram, draft model) gives the single-process tokens in
disaggregated mode (the prefill worker's first token, then verified proposals), and greedy
tokens equal to plain decoding."""

from __future__ import annotations

import json
import shutil

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

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
         "she saw a big, red ball.")


def _draft(tmp_path):
    from safetensors.torch import load_file, save_file

    dst = shutil.copytree(BUNDLED_MODEL, tmp_path / "draft")
    config = json.loads((dst / "config.json").read_text())
    config["num_hidden_layers"] = 4
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(dst / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".layers.4." not in k}, dst / "model.safetensors",
              metadata={"format": "pt"})
    return dst


async def _tokens(stream) -> tuple[list[int], str | None]:
    outs = [o async for o in stream]
    return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason


@pytest.mark.parametrize("method", ["ngram", "draft"])
async def test_a_speculating_decode_worker_matches_single_process(method, tmp_path):
    spec = {"speculative_method": method, "num_speculative_tokens": 3, "speculative_adaptive": False}
    if method == "draft":
        spec["speculative_model"] = str(_draft(tmp_path))
    else:
        spec["ngram_min"] = 1
    opts = WorkerOptions()
    prefill = PrefillWorker(make_engine(EngineArgs(model=str(BUNDLED_MODEL), num_kv_blocks=96), opts), opts)
    decode = DecodeWorker(AsyncEngine(EngineArgs(model=str(BUNDLED_MODEL), num_kv_blocks=96, **spec)), opts)
    # Seeded sampling with speculation draws other uniforms than without (lossless in distribution,
    # not per seed): the reference speculates too. Greedy is checked against plain decoding below.
    ref = AsyncEngine(EngineArgs(model=str(BUNDLED_MODEL), num_kv_blocks=96, **spec))
    plain = AsyncEngine(EngineArgs(model=str(BUNDLED_MODEL), num_kv_blocks=96))
    pport, dport = await prefill.start(), await decode.start()
    await ref.start()
    await plain.start()
    client = DecodeClient(f"127.0.0.1:{dport}")
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                  SamplingParams(temperature=0.8, seed=3, max_tokens=30, stop=["park"])]
        for i, p in enumerate(params):
            for j, prompt in enumerate([STORY + " " + STORY[:50], "Tom and Sue went to the park."]):
                rid = f"r{i}-{j}"
                got = await _tokens(client.generate(prompt, p, rid, prefill_addr=f"127.0.0.1:{pport}"))
                want = await _tokens(ref.generate(prompt, p, rid))
                assert got == want, rid
                if p.temperature == 0:
                    assert got == await _tokens(plain.generate(prompt, p, rid + "-plain")), rid
        stats = decode.engine.engine.stats()
        assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
        await assert_all_free(prefill.engine, decode.engine)
    finally:
        await client.close()
        await prefill.stop(0)
        await decode.stop(0)
        await ref.shutdown()
        await plain.shutdown()
