"""One rank of the expert-parallel test: joins a gloo group, sets this process's ParallelState
(EP = the TP group), builds the engine and runs greedy requests; writes its tokens, logprobs and
the bytes of experts it loaded to a JSON file. Run: moe_ep_worker.py MODEL RANK WORLD PORT OUT [int8]."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch.distributed as dist
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.engine.parallel.state import ParallelState, set_parallel_state
from kvrelay.engine.sampling_params import SamplingParams

PROMPTS = ["Once upon a time", "Lily went to the park and saw", "A", "Tom and Sue went to the park."]


def run(model: str, rank: int, world: int, port: int, quantization: str | None = None) -> dict:
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        set_parallel_state(ParallelState(tp_rank=rank, tp_size=world, tp_group=dist.group.WORLD,
                                         expert_parallel=True))
    engine = LLMEngine(EngineArgs(model=model, max_num_batched_tokens=7, block_size=4, quantization=quantization))
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, logprobs=5)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, params, str(i))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    logprobs: dict[str, list] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_work():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            logprobs[o.request_id] += [[lp.token_id, lp.logprob, lp.top] for lp in o.logprobs or []]
    moe = [lw.moe for lw in engine.model.w.layers if lw.moe is not None]
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "expert_bytes": engine.model.expert_bytes(),
        "expert_start": [m.expert_start for m in moe],
        "experts_held": [m.w13.shape[0] for m in moe],
        "load_total": engine.model.expert_load().total,
    }


if __name__ == "__main__":
    model, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    result = run(model, rank, world, port, sys.argv[6] if len(sys.argv) > 6 else None)
    with open(out, "w") as f:
        json.dump(result, f)
    if world > 1:
        dist.destroy_process_group()
