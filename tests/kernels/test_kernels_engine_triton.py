"""The engine end to end on stories260K: the Triton backend (interpreted) must pick the same greedy
tokens as the torch backend, through chunked prefill, batched decode, prefix-cache hits and int8."""

from __future__ import annotations

import pytest
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.engine.sampling_params import SamplingParams

PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park",
    "The dog",
    "Tom and Sue went to the beach to look for shells. The sun was hot and the",
]


def greedy_tokens(
    backend: str, quantization: str | None, max_tokens: int
) -> tuple[dict[str, list[int]], int]:
    engine = LLMEngine(EngineArgs(
        kernel_backend=backend, device="cpu", quantization=quantization, num_kv_blocks=64, block_size=16,
        max_num_batched_tokens=24,  # prompts go in chunks that attend to their already cached part
    ))
    assert engine.ops.backend == backend
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    # The first prompt runs alone so that the second, which extends it, hits the prefix cache.
    for first, batch in ((0, PROMPTS[:1]), (1, PROMPTS[1:])):
        for i, prompt in enumerate(batch):
            engine.add_request(prompt, params, request_id=str(first + i))
        while engine.has_work():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens, engine.stats().prefix_cache_hits


@pytest.mark.parametrize("quantization,max_tokens", [(None, 16), ("int8", 6)])
def test_triton_backend_matches_torch_greedy_tokens(quantization, max_tokens):
    want, want_hits = greedy_tokens("torch", quantization, max_tokens)
    got, got_hits = greedy_tokens("triton", quantization, max_tokens)
    assert sorted(want) == [str(i) for i in range(len(PROMPTS))]
    assert all(len(t) == max_tokens for t in want.values())
    assert want_hits > 0 and got_hits == want_hits
    assert got == want
