"""Disaggregated output == single-process output, token for token (greedy and seeded sampling),
for stories260K and a random tiny Llama, including prefix-cache hits on the prefill side,
prompts spanning many KV chunks, and layer-wise streamed hand-offs."""

from __future__ import annotations

import dataclasses
import random

import pytest
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.worker_base import WorkerOptions
from pd_helpers import assert_all_free, start_pair, stop_pair

from kvrelay.models import BUNDLED_MODEL

PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True,
                             logprobs=3),
    "seeded_stop": SamplingParams(temperature=0.7, seed=7, max_tokens=40, min_tokens=2, stop=["the"]),
}


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(0)
    base = [rng.randrange(3, 512) for _ in range(400)]
    return {
        "short": base[:5],  # less than one block
        "one_block": base[:16],  # exactly one full block
        "long": base[:300],  # many chunks at 16 KiB per message
        "shared_prefix_a": base[:200] + [7, 8, 9],
        "shared_prefix_b": base[:200] + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27],
        "longest": base[:400],
    }


async def _collect(stream):
    outs = [o async for o in stream]
    tokens = [t for o in outs for t in o.new_token_ids]
    text = "".join(o.text for o in outs)
    logprobs = [lp for o in outs for lp in (o.logprobs or [])]
    return tokens, text, logprobs, outs


@pytest.mark.parametrize("model_name", ["stories260K", "tiny_llama"])
@pytest.mark.parametrize("streaming", [True, False], ids=["layer_streamed", "after_prefill"])
async def test_disaggregated_equals_single_process(model_name, streaming, tiny_llama):
    model = BUNDLED_MODEL if model_name == "stories260K" else tiny_llama
    opts = WorkerOptions(max_message_bytes=16 * 1024, stream_min_tokens=0 if streaming else 10**9,
                         layer_group_size=1)
    pair = await start_pair(model, prefill_options=opts, decode_options=opts)
    ref = AsyncEngine(EngineArgs(model=str(model), num_kv_blocks=96))
    await ref.start()
    try:
        prompts = _prompts()
        hits = 0
        for pname, prompt in prompts.items():
            for kind, params in PARAMS.items():
                rid = f"{pname}-{kind}"
                got = await _collect(pair.client.generate(prompt, params, rid, prefill_addr=pair.prefill_addr))
                want = await _collect(ref.generate(prompt, params, rid))
                assert got[0] == want[0], f"{model_name} {pname} {kind}: tokens differ"
                assert got[1] == want[1]
                assert [(lp.token_id, lp.logprob, lp.top) for lp in got[2]] == \
                       [(lp.token_id, lp.logprob, lp.top) for lp in want[2]]
                assert got[3][-1].finish_reason == want[3][-1].finish_reason
                assert got[3][-1].stop_reason == want[3][-1].stop_reason
                hits += got[3][0].num_cached_tokens > 0
        # Repeated prompts and the shared prefix were served from the prefill side's prefix cache.
        assert hits >= len(prompts) * (len(PARAMS) - 1)
        transferred = pair.decode.metrics.kv_bytes._value.get()
        assert transferred > 0
        if streaming:  # some bytes left while the prompt was still being computed
            assert pair.decode.metrics.kv_overlap_bytes._value.get() > 0
        else:
            assert pair.decode.metrics.kv_overlap_bytes._value.get() == 0
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)
        await ref.shutdown()


@pytest.mark.parametrize("model_name", ["stories260K", "tiny_llama"])
async def test_follow_up_turn_moves_only_the_blocks_the_decode_worker_lacks(model_name, tiny_llama, tmp_path):
    """A second turn (the first prompt, its answer, new tokens) finds the first turn's blocks,
    generated ones included, in the decode worker's own prefix cache: its hand-off moves only the
    blocks after them, through shared memory too, and the output equals the single process's.
    A failed attempt that had shared those cached blocks gives them back."""
    from pd_helpers import free_port

    model = BUNDLED_MODEL if model_name == "stories260K" else tiny_llama
    popts = WorkerOptions(max_message_bytes=16 * 1024)
    dopts = WorkerOptions(max_message_bytes=16 * 1024, kv_shm_bytes=4 << 20, kv_shm_dir=str(tmp_path))
    pair = await start_pair(model, prefill_options=popts, decode_options=dopts)
    ref = AsyncEngine(EngineArgs(model=str(model), num_kv_blocks=96))
    await ref.start()
    block_bytes = pair.decode.layout.bytes_per_block_layer * pair.decode.layout.num_layers
    try:
        rng = random.Random(5)
        turn1 = [rng.randrange(3, 512) for _ in range(150)]
        got = await _collect(pair.client.generate(turn1, PARAMS["greedy"], prefill_addr=pair.prefill_addr))
        want = await _collect(ref.generate(turn1, PARAMS["greedy"]))
        assert got[0] == want[0]
        turn2 = turn1 + got[0] + [rng.randrange(3, 512) for _ in range(37)]  # 211 tokens, 14 blocks
        moved = []
        for kind in ("greedy", "seeded"):
            before = pair.decode.metrics.kv_bytes._value.get()
            got = await _collect(pair.client.generate(turn2, PARAMS[kind], prefill_addr=pair.prefill_addr))
            want = await _collect(ref.generate(turn2, PARAMS[kind]))
            assert got[0] == want[0], f"{model_name} {kind}: tokens differ"
            # Logprobs agree to float rounding only: the prefill worker never saw turn 1's answer,
            # so it computes turn 2 from block 9 on in one chunk, where the single process starts
            # at block 10 (it cached the answer's first full block); the same sums, split apart.
            for a, b in zip(got[2], want[2], strict=True):
                assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            moved.append((pair.decode.metrics.kv_bytes._value.get() - before) / block_bytes)
        # Turn 1 computed the K/V of 173 tokens (150 + 24 generated, the last one never fed back):
        # 10 full blocks. The seeded run then also finds turn 2's 13 full prompt blocks.
        # (A hand-off that failed and fell back to a local prefill moves nothing: say so first.)
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 0, "a hand-off fell back locally"
        assert moved == [14 - 10, 14 - 13]
        dead = f"127.0.0.1:{free_port()}"  # the first attempt fails after its reservation
        got = await _collect(pair.client.generate(turn2, PARAMS["greedy"], prefill_addr=[dead, pair.prefill_addr]))
        assert got[0] == (await _collect(ref.generate(turn2, PARAMS["greedy"])))[0]
        assert pair.prefill.metrics.shm_offers.labels("accepted")._value.get() == 4
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
        assert pair.decode.arena.free_bytes == pair.decode.arena.capacity
    finally:
        await stop_pair(pair)
        await ref.shutdown()


async def test_prompt_spanning_many_chunks_with_chunked_prefill(tiny_llama):
    """A prompt longer than the prefill's token budget (chunked prefill over several steps) and
    much larger than one message: only the final step streams, the rest comes from held blocks."""
    opts = WorkerOptions(max_message_bytes=8 * 1024, stream_min_tokens=0, layer_group_size=1)
    from kvrelay.decode.worker import DecodeWorker
    from kvrelay.kvtransfer.client import DecodeClient
    from kvrelay.prefill.worker import PrefillWorker

    args = EngineArgs(model=str(tiny_llama), num_kv_blocks=96, max_num_batched_tokens=128)
    p, d = PrefillWorker(AsyncEngine(args), opts), DecodeWorker(AsyncEngine(args), opts)
    pp, dp = await p.start(), await d.start()
    ref = AsyncEngine(args)
    await ref.start()
    client = DecodeClient(f"127.0.0.1:{dp}")
    try:
        rng = random.Random(1)
        prompt = [rng.randrange(3, 512) for _ in range(450)]
        for params in (PARAMS["greedy"], PARAMS["seeded"]):
            got = await _collect(client.generate(prompt, params, prefill_addr=f"127.0.0.1:{pp}"))
            want = await _collect(ref.generate(prompt, params))
            assert got[0] == want[0]
        await assert_all_free(p.engine, d.engine)
    finally:
        await client.close()
        await p.stop(0)
        await d.stop(0)
        await ref.shutdown()


async def test_n_greater_than_one_is_prefilled_on_the_decode_worker():
    pair = await start_pair()
    ref = AsyncEngine(EngineArgs(num_kv_blocks=96))
    await ref.start()
    try:
        params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=10)
        prompt = list(range(10, 60))
        got = [o async for o in pair.client.generate(prompt, params, "n3", prefill_addr=pair.prefill_addr)]
        want = [o async for o in ref.generate(prompt, params, "n3")]
        for i in range(3):
            assert [t for o in got if o.index == i for t in o.new_token_ids] == \
                   [t for o in want if o.index == i for t in o.new_token_ids]
        assert pair.decode.metrics.kv_bytes._value.get() == 0  # no hand-off for n > 1
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)
        await ref.shutdown()


@pytest.mark.parametrize("plane", ["grpc", "shm"])
async def test_concurrent_handoffs_match_and_leave_no_blocks(tiny_llama, tmp_path, plane):
    """Many hand-offs at once: several prompts finish their prefill in the same step (the layer
    hook serves each), decode batches them; outputs match and both pools end fully free. With a
    shared-memory arena that holds only a few prompts' K/V at once, the rest go inline, and the
    arena ends fully free too."""
    import asyncio

    opts = WorkerOptions(max_message_bytes=16 * 1024, stream_min_tokens=0, layer_group_size=1)
    dopts = opts if plane == "grpc" else dataclasses.replace(opts, kv_shm_bytes=512 * 1024,
                                                              kv_shm_dir=str(tmp_path))
    pair = await start_pair(tiny_llama, num_kv_blocks=256, prefill_options=opts, decode_options=dopts)
    ref = AsyncEngine(EngineArgs(model=str(tiny_llama), num_kv_blocks=256))
    await ref.start()
    try:
        rng = random.Random(5)
        shared = [rng.randrange(3, 512) for _ in range(64)]
        prompts = [(shared if i % 3 == 0 else []) + [rng.randrange(3, 512) for _ in range(rng.randrange(5, 150))]
                   for i in range(12)]
        params = [PARAMS["greedy"] if i % 2 else PARAMS["seeded"] for i in range(12)]
        got = await asyncio.gather(*(
            _collect(pair.client.generate(p, sp, f"c{i}", prefill_addr=pair.prefill_addr))
            for i, (p, sp) in enumerate(zip(prompts, params))))
        for i, (p, sp) in enumerate(zip(prompts, params)):
            want = await _collect(ref.generate(p, sp, f"c{i}"))
            assert got[i][0] == want[0], f"request {i}"
        if plane == "shm":
            assert pair.prefill.metrics.shm_offers.labels("accepted")._value.get() >= 1
            assert pair.decode.arena.free_bytes == pair.decode.arena.capacity
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)
        await ref.shutdown()


async def test_text_prompt_is_tokenized_like_the_engine():
    pair = await start_pair()
    ref = AsyncEngine(EngineArgs(num_kv_blocks=96))
    await ref.start()
    try:
        text = "Once upon a time there was a little dog who liked to run in the park"
        got = await _collect(pair.client.generate(text, PARAMS["seeded"], prefill_addr=pair.prefill_addr))
        want = await _collect(ref.generate(text, PARAMS["seeded"]))
        assert got[0] == want[0] and got[1] == want[1]
        assert pair.decode.metrics.kv_bytes._value.get() > 0
    finally:
        await stop_pair(pair)
        await ref.shutdown()
