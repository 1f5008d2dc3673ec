"""fp8 experts under expert parallelism (2 gloo worker processes): each rank quantizes only its own
experts, per expert and output channel, so TP=2 with --enable-expert-parallel gives exactly the tokens
and logprobs of TP=2 with the experts replicated. (Against one process fp8 differs under TP: a
row-parallel projection's per-token activation scale sees only its rank's part of the row.)"""

from __future__ import annotations

import torch
from helpers import PROMPTS, make_engine
from kvrelay.engine.sampling_params import SamplingParams
from tiny_models import save_tiny_model

KV = {"kv_cache_memory": 4 * 2**20, "max_num_batched_tokens": 7, "block_size": 4, "quantization": "fp8"}


def _run(engine) -> tuple[dict, dict]:
    params = SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0, logprobs=3)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(p, params, str(i))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(3)}
    logprobs: dict[str, list[float]] = {str(i): [] for i in range(3)}
    try:
        while engine.has_work():
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
                logprobs[o.request_id] += [lp.logprob for lp in o.logprobs or []]
    finally:
        engine.close()
    return tokens, logprobs


def test_fp8_experts_split_over_ranks_equal_replicated_experts(tmp_path):
    model = save_tiny_model(tmp_path / "mixtral", "mixtral")  # top-2: a + b or (a + 0) + (0 + b), exact
    replicated = _run(make_engine(model, tensor_parallel_size=2, **KV))
    split = _run(make_engine(model, tensor_parallel_size=2, enable_expert_parallel=True, **KV))
    assert all(len(t) == 10 for t in split[0].values())
    assert split == replicated
    one = make_engine(model, **KV)  # and the experts are fp8 (one process's layout, as each rank's)
    assert one.model.w.layers[0].moe.w13.dtype == torch.float8_e4m3fn
