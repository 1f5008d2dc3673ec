"""The model runner: persistent input batch, padded decode steps, deferred outputs, CUDA graphs."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import PROMPTS, greedy, make_engine, run_engine
from kvrelay.engine.runner.cuda_graphs import bucket_sizes
from kvrelay.engine.runner.input_batch import BlockTableRows
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence, Status

from kvrelay.models import BUNDLED_MODEL


def _collect(engine, requests: dict[str, tuple], abort_after: dict[str, int] | None = None) -> dict:
    """Run to completion; per (request, sample): tokens, text, finish reason, logprobs."""
    abort_after = abort_after or {}
    out: dict[tuple, dict] = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
    while engine.has_work():
        for o in engine.step():
            rec = out.setdefault((o.request_id, o.index), {"ids": [], "text": "", "reason": None, "lps": []})
            rec["ids"] += o.new_token_ids
            rec["text"] += o.text
            rec["lps"] += [lp.logprob for lp in o.logprobs or []]
            rec["reason"] = o.finish_reason
            if o.request_id in abort_after and len(rec["ids"]) >= abort_after[o.request_id]:
                del abort_after[o.request_id]
                for a in engine.abort(o.request_id):
                    r = out[(a.request_id, a.index)]
                    r["ids"] += a.new_token_ids
                    r["text"] += a.text
                    r["reason"] = a.finish_reason
    return out


def _mixed_requests() -> dict[str, tuple]:
    return {
        "greedy": (PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0)),
        "stop_string": (PROMPTS[2], SamplingParams(max_tokens=60, temperature=0.0, stop=[" the", "."])),
        "seeded_n3": (PROMPTS[3], SamplingParams(max_tokens=30, temperature=0.9, seed=7, n=3, logprobs=2)),
        "stop_id": (PROMPTS[1], SamplingParams(max_tokens=50, temperature=0.7, seed=3, stop_token_ids=[13])),
        "penalised": (PROMPTS[5], SamplingParams(max_tokens=25, temperature=0.0, repetition_penalty=1.3)),
        "aborted": (PROMPTS[4], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)),
        "short": (PROMPTS[4], SamplingParams(max_tokens=1, temperature=0.0)),
    }


@pytest.mark.parametrize("chunk", [2048, 7])
def test_deferred_outputs_equal_the_synchronous_engine(chunk):
    """Detokenizing a step's tokens during the next forward (the CUDA default) changes nothing a
    client sees: tokens, text, stop strings, finish reasons, logprobs, aborts, seeds."""
    results = []
    for defer in (False, True):
        engine = make_engine(BUNDLED_MODEL, async_output=defer, max_num_batched_tokens=chunk)
        assert engine.defer_outputs is defer
        results.append(_collect(engine, _mixed_requests(), abort_after={"aborted": 5}))
        assert engine.pool.num_free == engine.pool.num_blocks or engine.args.enable_prefix_caching
        assert not engine.requests and not engine._deferred
    sync, deferred = results
    assert deferred.keys() == sync.keys()
    for key, want in sync.items():
        got = deferred[key]
        assert {k: got[k] for k in ("ids", "text", "reason")} == {k: want[k] for k in ("ids", "text", "reason")}
        # A finished sequence may run one more (dropped) step, so batches differ: float sums too.
        assert got["lps"] == pytest.approx(want["lps"], abs=1e-4), key
    assert sync[("stop_string", 0)]["reason"] == "stop" and sync[("aborted", 0)]["reason"] == "abort"
    assert len(sync[("aborted", 0)]["ids"]) >= 5


def test_deferred_outputs_drop_a_token_computed_past_a_stop_string():
    """A stop string is only seen when the next step is already scheduled: that step's token for the
    sequence is dropped, and its blocks are freed, exactly as if it had stopped in time."""
    engine = make_engine(BUNDLED_MODEL, async_output=True, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=200, temperature=0.0, stop=["."])
    out = _collect(engine, {"s": (PROMPTS[0], params)})
    rec = out[("s", 0)]
    assert rec["reason"] == "stop" and "." not in rec["text"] and rec["text"]
    ref = _collect(make_engine(BUNDLED_MODEL), {"s": (PROMPTS[0], params)})
    assert rec == ref[("s", 0)]
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.generation_tokens_total == len(rec["ids"])


def test_padded_decode_steps_give_the_same_tokens():
    """CUDA graph steps are padded to a bucket with rows that write nothing and attend to nothing;
    the same padding run eagerly on CPU must not change a token."""
    requests = {str(i): (p, greedy(24)) for i, p in enumerate(PROMPTS)}
    want = run_engine(make_engine(BUNDLED_MODEL), requests)
    engine = make_engine(BUNDLED_MODEL)
    build = engine.runner.inputs.build
    padded_steps = []

    def padded(seqs, num_new, pad_decode_to=None, all_logits=frozenset()):
        if pad_decode_to is None and all(n == 1 for n in num_new):
            pad_decode_to = len(num_new) + 3
            padded_steps.append(pad_decode_to)
        return build(seqs, num_new, pad_decode_to, all_logits)

    engine.runner.inputs.build = padded
    assert run_engine(engine, requests) == want
    assert padded_steps


def _seq(seq_id: int) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), index=0, token_ids=[1], prompt_len=1,
                    params=SamplingParams(), priority=0, max_tokens=1, detok=None, metrics=None)


def test_block_table_rows_follow_appends_and_replacements():
    rows = BlockTableRows(max_blocks=8, capacity=2)
    rng = random.Random(0)
    seqs = [_seq(i) for i in range(5)]  # more than the capacity: rows grow, then get reused
    for _ in range(300):
        seq = rng.choice(seqs)
        action = rng.random()
        if action < 0.6 and len(seq.block_table) < 8:
            seq.block_table.append(rng.randrange(1000))
        elif action < 0.75:  # freed (preempted or finished), then refilled
            seq.block_table = [rng.randrange(1000) for _ in range(rng.randint(0, 3))]
            seq.table_epoch += 1
        elif action < 0.8:
            seq.status = Status.FINISHED if seq.status is not Status.FINISHED else Status.RUNNING
        row = rows.row(seq)
        assert rows.table[row, : len(seq.block_table)].tolist() == seq.block_table
    for seq in seqs:
        seq.status = Status.RUNNING
    live = {rows.row(s) for s in seqs}
    assert len(live) == len(seqs)  # no two running sequences share a row


def test_block_table_refuses_more_blocks_than_the_context_holds():
    rows = BlockTableRows(max_blocks=2)
    seq = _seq(0)
    seq.block_table = [1, 2, 3]
    with pytest.raises(ValueError, match="max_model_len"):
        rows.row(seq)


def test_graph_buckets():
    assert bucket_sizes(1) == [8]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert bucket_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and bucket_sizes(256)[-1] == 256


def test_cpu_defaults_keep_the_synchronous_engine_and_no_graphs():
    engine = make_engine(BUNDLED_MODEL)
    assert engine.runner.graphs is None and engine.defer_outputs is False
    with pytest.raises(ValueError, match="CUDA graphs need"):
        engine.runner.capture_graphs([1])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_graphs_give_the_eager_tokens():  # pragma: no cover - runs where CUDA is present
    requests = {str(i): (p, greedy(32)) for i, p in enumerate(PROMPTS)}
    eager = make_engine(BUNDLED_MODEL, device="cuda", enforce_eager=True, kv_cache_memory=64 * 2**20)
    graphs = make_engine(BUNDLED_MODEL, device="cuda", kv_cache_memory=64 * 2**20, max_num_seqs=16)
    assert graphs.runner.graphs is not None
    assert run_engine(graphs, requests) == run_engine(eager, requests)
    assert graphs.runner.graph_steps > 0


@cuda
def test_gpu_memory_utilization_sizes_the_kv_cache():  # pragma: no cover
    small = make_engine(BUNDLED_MODEL, device="cuda", gpu_memory_utilization=0.05, enforce_eager=True)
    larger = make_engine(BUNDLED_MODEL, device="cuda", gpu_memory_utilization=0.1, enforce_eager=True)
    assert larger.pool.num_blocks > small.pool.num_blocks > 0


def test_cli_flags_of_the_fast_path():
    import argparse

    from kvrelay.engine.engine_args import EngineArgs, cpu_kv_cache_blocks

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli(parser.parse_args(["--gpu-memory-utilization", "0.8", "--enforce-eager"]))
    assert args.gpu_memory_utilization == 0.8 and args.enforce_eager and args.kv_cache_memory is None
    engine = make_engine(BUNDLED_MODEL)  # CPU without --kv-cache-memory: the CPU rule
    per_block = engine.kv_cache[:, :, 0].numel() * engine.kv_cache.element_size()
    per_seq = engine.max_model_len // 16
    # The bundled model's 256 full-length sequences (~170 MB) fit in a tenth of this machine's memory.
    assert engine.pool.num_blocks == 256 * per_seq
    # The rule: all sequences if they fit in a tenth of the memory, else that tenth, at least one sequence.
    assert cpu_kv_cache_blocks(per_block, 16, 8, 512, available=10**12) == 8 * 32
    assert cpu_kv_cache_blocks(1000, 16, 256, 512, available=10**6) == 100
    assert cpu_kv_cache_blocks(1000, 16, 256, 512, available=10**3) == 32
