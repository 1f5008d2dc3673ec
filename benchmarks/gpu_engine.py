"""The GPU fast path on one device, in one run: parity, decode step time, throughput, kernels.

    python3 benchmarks/gpu_engine.py               # one H200: a few minutes; installs nothing
    python3 benchmarks/gpu_engine.py --cpu-smoke   # no GPU: tiny shapes, checks that every section runs

Runs on a bare GPU machine with torch, triton and transformers: kvrelay is mapped from the checkout
(benchmarks/package_map.py). Sections (--only parity,step,throughput,kernels):
- parity: stories260K greedy on the device, with decode CUDA graphs and with --enforce-eager, each
  also with --async-scheduling, against the CPU torch path; and with a LoRA adapter on half the prompts;
- step: one decode step's wall time against the GPU's busy time (kernel time from torch.profiler, and
  the graph's replay alone), graphs on (with and without --async-scheduling) and off, at 128
  sequences of ~512 tokens and 16 of ~2048;
- throughput: Llama-3.2-1B shapes (random bf16 weights), 128 requests, prompts 32-1024, outputs
  32-256, EOS ignored: kvrelay with graphs (with and without --async-scheduling), eager, and HF
  generate in a padded batch of 32 on the same weights;
- kernels: decode attention (with a split-count sweep at batch 1), prefill attention against SDPA,
  int8 W8A16 and FP8 W8A8 (torch._scaled_mm, rowwise scales) against bf16 F.linear;
- spec: speculative decoding on the 1B shapes (benchmarks/gpu_spec.py);
- handoff: prefill/decode hand-off TTFT at 512-4000 tokens, unified vs K/V on gRPC vs the CUDA IPC
  plane (benchmarks/gpu_handoff.py);
- handoff_procs: the same with the prefill and decode workers in their own processes, a real CUDA
  IPC handle between them (benchmarks/gpu_handoff_procs.py);
- moe: a Mixtral-shaped model (8 experts, top-2) with graphs, eager and the torch MoE reference
  (benchmarks/gpu_moe.py);
- parallel_step: the decode step through one worker process (--distributed-executor-backend mp) at
  the 1B shapes, sampling on the worker against every row's logits sent to the driver
  (benchmarks/gpu_parallel_step.py);
- penalties: repetition/frequency/presence penalties of 128 rows of a 128k vocabulary, the batched
  sampler.penalize against the per-row code it replaced (benchmarks/penalties.py);
- parallel: stories260K greedy through the tensor/pipeline worker path (torch.distributed, NCCL) at
  world size 1 (--distributed-executor-backend mp, also with --async-scheduling), and at TP=2 and
  PP=2 when there are 2+ GPUs, against the in-process engine.
Each section reports its own failure and the run goes on; the summary comes last. With $OUT set, the
figures also go to $OUT/gpu_engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import prefill_all, write_word_tokenizer
from gpu_handoff import section_handoff
from gpu_handoff_procs import section_handoff_procs
from gpu_kernels_section import profiled_kernel_ms, section_kernels
from gpu_moe import section_moe
from gpu_parallel_step import section_parallel_step
from gpu_spec import section_spec
from gpu_vision import parity_vision
from package_map import ROOT, map_kvrelay
from penalties import measure as measure_penalties

LLAMA_1B = {  # Llama-3.2-1B's shapes
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
TINY = LLAMA_1B | {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                   "max_position_embeddings": 256, "torch_dtype": "float32"}
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They saw", "One day, a big"]


class Report:
    """Figures as they come: printed, and written to $OUT/gpu_engine.json after each one, so a run
    cut off by its time limit still leaves what it measured."""

    def __init__(self):
        self.lines: list[str] = []
        self.data: dict = {}
        out = os.environ.get("OUT")
        self.path = Path(out, "gpu_engine.json") if out else None

    def add(self, key: str, value, line: str) -> None:
        self.data[key] = value
        self.lines.append(line)
        print(line, flush=True)
        self.save()

    def save(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=1, default=str))


def make_1b_dir(path: Path, config: dict, device: str) -> Path:
    """config.json, a word tokenizer, and random HF weights initialised on the device (fast)."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_config).to(getattr(torch, config["torch_dtype"]))
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config))
    write_word_tokenizer(path, config["vocab_size"])
    del model
    return path


def engine_for(model_dir, device: str, **kw):
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=str(model_dir), device=device, **kw))


def greedy_tokens(engine, prompts, n: int, loras: list[str | None] | None = None) -> list[list[int]]:
    """Greedy tokens of each prompt (loras: each prompt's LoRA adapter, None for the base model)."""
    from kvrelay.engine.sampling_params import SamplingParams

    for i, p in enumerate(prompts):
        lora = loras[i] if loras else None
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, lora=lora), f"p{i}")
    out = {f"p{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"p{i}"] for i in range(len(prompts))]


def generate_all(engine, reqs, tag: str, split: dict | None = None) -> tuple[int, float]:
    """Run every (prompt ids, output length) request, greedy with EOS ignored: (tokens, seconds).
    split, when given, gets the steps and seconds of the engine.step() calls that scheduled prompt
    tokens ("mixed": prefill, eager) and of those that scheduled decodes only ("decode")."""
    from kvrelay.engine.sampling_params import SamplingParams

    schedule = engine.scheduler.schedule
    kind = ["decode"]

    def classify():
        step = schedule()
        kind[0] = "mixed" if any(n > 1 or s.num_computed < s.prompt_len for s, n in zip(step.seqs, step.num_new)) \
            else "decode"
        return step

    if split is not None:
        engine.scheduler.schedule = classify
    start = time.perf_counter()
    for i, (ids, n) in enumerate(reqs):
        engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), f"{tag}{i}")
    generated = 0
    while engine.has_work():
        t0 = time.perf_counter()
        generated += sum(len(o.new_token_ids) for o in engine.step())
        if split is not None:
            steps, secs = split.get(kind[0], (0, 0.0))
            split[kind[0]] = (steps + 1, secs + time.perf_counter() - t0)
    seconds = time.perf_counter() - start
    if split is not None:
        del engine.scheduler.schedule  # the bound method again
    return generated, seconds


def split_text(split: dict) -> str:
    return ", ".join(f"{k} steps {n} in {s:.2f} s ({1e3 * s / n:.2f} ms each)" for k, (n, s) in sorted(split.items())
                     if n)


def set_async_scheduling(engine, on: bool) -> None:
    """Turn --async-scheduling on or off on a built engine between runs (nothing in flight)."""
    from kvrelay.engine.async_scheduling import AsyncScheduling

    while engine.has_work():  # aborted requests may leave a step in flight
        engine.step()
    engine.overlap = AsyncScheduling(engine) if on else None


# ---- sections ---------------------------------------------------------------------------------


def section_parity(rep: Report, device: str, smoke: bool) -> None:
    from kvrelay.models import BUNDLED_MODEL

    n = 48
    want = greedy_tokens(engine_for(BUNDLED_MODEL, "cpu", kernel_backend="torch"), PROMPTS, n)
    modes = {"eager": {"enforce_eager": True}, "eager_async": {"enforce_eager": True, "async_scheduling": True}}
    if not smoke:  # piecewise last: a failure there loses no other row
        modes = {"graphs": {}, "graphs_async": {"async_scheduling": True}} | modes | {
            "graphs_piecewise_async": {"async_scheduling": True, "piecewise_cuda_graphs": True,
                                       "max_num_batched_tokens": 24}}  # chunked: prefill steps with decodes
    for name, kw in modes.items():
        engine = engine_for(BUNDLED_MODEL, device, kv_cache_memory=64 * 2**20, max_num_seqs=16, **kw)
        got = greedy_tokens(engine, PROMPTS, n)
        same = sum(g == w for g, w in zip(got, want))
        graph_steps = engine.runner.graph_steps
        rep.add(f"parity_{name}", {"identical": same, "of": len(PROMPTS), "graph_steps": graph_steps},
                f"parity stories260K greedy, {device} {name}: {same}/{len(PROMPTS)} identical to CPU torch "
                f"({graph_steps} graph steps)")
    # LoRA: every other prompt on a random adapter, in the same batches as the base model's (steps
    # with adapter rows run eagerly, the base model's alone replay graphs).
    from lora import write_adapter

    config = json.loads((Path(BUNDLED_MODEL) / "config.json").read_text())
    loras = [None, "a"] * (len(PROMPTS) // 2)
    with tempfile.TemporaryDirectory() as tmp:
        modules = [f"a={write_adapter(Path(tmp) / 'a', config, rank=8, seed=0, std=0.3)}"]
        want_lora = greedy_tokens(engine_for(BUNDLED_MODEL, "cpu", kernel_backend="torch", lora_modules=modules),
                                  PROMPTS, n, loras)
        engine = engine_for(BUNDLED_MODEL, device, kv_cache_memory=64 * 2**20, max_num_seqs=16, lora_modules=modules)
        got = greedy_tokens(engine, PROMPTS, n, loras)
    same = sum(g == w for g, w in zip(got, want_lora))
    changed = sum(want_lora[i] != want[i] for i, lora in enumerate(loras) if lora)  # the adapter matters
    rep.add("parity_lora", {"identical": same, "of": len(PROMPTS), "adapter_changed": changed,
                            "graph_steps": engine.runner.graph_steps},
            f"parity stories260K greedy, a LoRA adapter on half the prompts, {device}: {same}/{len(PROMPTS)} "
            f"identical to CPU torch (the adapter changed {changed}/{loras.count('a')} outputs; "
            f"{engine.runner.graph_steps} graph steps)")
    # Embeddings (--runner pooling): MEAN pooling, so every prompt row comes back, in 24-token chunks.
    ref, got = (embed_vectors(engine_for(BUNDLED_MODEL, where, runner="pooling", max_num_batched_tokens=24,
                                         pooler_config='{"pooling_type": "MEAN"}', **kw), PROMPTS)
                for where, kw in (("cpu", {"kernel_backend": "torch"}), (device, {"kv_cache_memory": 64 * 2**20})))
    diff = max(abs(a - b) for u, v in zip(ref, got) for a, b in zip(u, v))
    rep.add("parity_pooling", {"max_abs_diff": diff, "of": len(PROMPTS), "ok": diff < 1e-3},
            f"parity stories260K embeddings (MEAN, normalized), {device} against CPU torch: max |diff| {diff:.1e} "
            f"over {len(PROMPTS)} prompts ({'ok' if diff < 1e-3 else 'MISMATCH'})")
    with tempfile.TemporaryDirectory() as tmp:  # images: a tiny LLaVA (benchmarks/gpu_vision.py)
        parity_vision(rep, device, engine_for, greedy_tokens, PROMPTS, Path(tmp))


def embed_vectors(engine, prompts: list[str]) -> list[list[float]]:
    from kvrelay.engine.pooling.params import PoolingParams
    from kvrelay.engine.sampling_params import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(pooling=PoolingParams()), f"emb{i}")
    done = {}
    while engine.has_work():
        done |= {o.request_id: o.embedding for o in engine.step() if o.finished}
    return [done[f"emb{i}"] for i in range(len(prompts))]


def section_parallel(rep: Report, device: str, smoke: bool) -> None:
    import torch

    from kvrelay.models import BUNDLED_MODEL

    n, kv = 32, {"kv_cache_memory": 64 * 2**20, "max_num_seqs": 16}
    base = engine_for(BUNDLED_MODEL, device, **kv)
    want = greedy_tokens(base, PROMPTS, n)
    base.close()
    # The driver makes outputs while the worker computes: deferred (the CUDA default), and with
    # async scheduling, where step N+1's input ids come from step N's samples on the driver.
    configs = {"mp world size 1": {"distributed_executor_backend": "mp"},
               "mp_async world size 1, async scheduling": {"distributed_executor_backend": "mp",
                                                           "async_scheduling": True}}
    if device == "cuda" and torch.cuda.device_count() >= 2:  # one rank per GPU: NCCL refuses two on one
        configs |= {"TP=2": {"tensor_parallel_size": 2}, "PP=2": {"pipeline_parallel_size": 2},
                    "TP=2_async, async scheduling": {"tensor_parallel_size": 2, "async_scheduling": True}}
    for name, kw in configs.items():
        engine = engine_for(BUNDLED_MODEL, device, **kv, **kw)
        try:
            got = greedy_tokens(engine, PROMPTS, n)
        finally:
            engine.close()
        same = sum(g == w for g, w in zip(got, want))
        rep.add(f"parallel_{name.split()[0].replace('=', '').rstrip(',')}", {"identical": same, "of": len(PROMPTS)},
                f"parallel stories260K greedy, {device} {name}: {same}/{len(PROMPTS)} identical to one process")


def section_step(rep: Report, engine, vocab: int, cases, cuda: bool) -> None:
    import torch

    runner = engine.runner
    captured = runner.graphs
    for nseq, ctx in cases:
        for mode in ("graphs", "graphs_async", "eager") if captured is not None else ("eager", "eager_async"):
            runner.graphs = captured if mode.startswith("graphs") else None
            set_async_scheduling(engine, mode.endswith("_async"))
            steps, prof_steps = (30, 5) if cuda else (3, 0)
            prefill_all(engine, nseq, ctx, steps + prof_steps + 8, vocab, seed=nseq)
            for _ in range(3):
                engine.step()
            before = runner.graph_steps
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = (time.perf_counter() - start) * 1e3 / steps
            gpu = replay = None
            if cuda:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(prof_steps):
                        engine.step()
                    torch.cuda.synchronize()
                gpu = profiled_kernel_ms(prof, prof_steps)
                if mode.startswith("graphs"):
                    size = runner.graphs.bucket(nseq)
                    graph = runner.graphs.graphs[size][0]
                    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0.record()
                    for _ in range(20):
                        graph.replay()
                    t1.record()
                    torch.cuda.synchronize()
                    replay = t0.elapsed_time(t1) / 20
            for rid in list(engine.requests):
                engine.abort(rid)
            set_async_scheduling(engine, False)
            used = runner.graph_steps - before
            ratio = f"{wall / gpu:.2f}x" if gpu else "-"
            rep.add(f"step_{nseq}x{ctx}_{mode}",
                    {"wall_ms": wall, "gpu_kernel_ms": gpu, "replay_ms": replay, "graph_steps": used},
                    f"decode step {nseq} seqs x ~{ctx} tokens, {mode}: wall {wall:.2f} ms, GPU kernels "
                    f"{gpu if gpu is None else round(gpu, 3)} ms, graph replay alone "
                    f"{replay if replay is None else round(replay, 3)} ms, wall/GPU {ratio} "
                    f"({used}/{steps} steps on a graph)")
        runner.graphs = captured


def section_throughput(rep: Report, engine, model_dir: Path, reqs, hf_batch: int, cuda: bool) -> None:
    import torch

    runner = engine.runner
    captured = runner.graphs
    budget = engine.scheduler.config.max_num_batched_tokens  # the engine is built for the largest
    rates = {}
    modes = [("graphs", 2048), ("graphs_async", 2048), ("eager", 2048), ("graphs", budget),
             ("graphs_async", budget), ("graphs_piecewise_async", 2048), ("graphs_piecewise_async", budget)]
    if captured is None:
        modes = [("eager", 2048), ("eager_async", 2048), ("eager_piecewise_async", 2048)]
    piecewise = None
    for mode, tokens in modes:
        if "piecewise" in mode and piecewise is None:
            capture_piecewise(rep, runner, budget, cuda)
            piecewise = runner.piecewise
        runner.piecewise = piecewise if "piecewise" in mode else None
        runner.graphs = captured if mode.startswith("graphs") else None
        set_async_scheduling(engine, mode.endswith("_async"))
        engine.scheduler.config.max_num_batched_tokens = tokens
        split: dict = {}
        generated, seconds = generate_all(engine, reqs, "t", split)
        key = mode if tokens == 2048 else f"{mode}_{tokens}"
        rates[key] = generated / seconds
        rep.add(f"throughput_{key}", {"tokens": generated, "seconds": seconds, "tok_s": rates[key], "steps": split},
                f"throughput kvrelay {mode}, {tokens}-token step budget: {generated} tokens in {seconds:.2f} s = "
                f"{rates[key]:,.0f} tok/s ({split_text(split)})")
    runner.graphs = captured
    runner.piecewise = None
    set_async_scheduling(engine, False)
    engine.scheduler.config.max_num_batched_tokens = budget
    if not hf_batch:
        return
    import transformers

    dtype = engine.dtype
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(engine.device).eval()
    batch = reqs[:hf_batch]
    width = max(len(ids) for ids, _ in batch)
    new = max(n for _, n in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=engine.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=engine.device)
    with torch.no_grad():
        hf.generate(ids[:, -8:], attention_mask=mask[:, -8:], max_new_tokens=2, do_sample=False, pad_token_id=0)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                    pad_token_id=0)
        if cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    useful = sum(n for _, n in batch)
    hf_rate = useful / seconds
    best = max(rates.values())
    rep.add("throughput_hf", {"tokens": useful, "seconds": seconds, "tok_s": hf_rate},
            f"throughput HF generate, one padded batch of {len(batch)}: {useful} useful tokens in {seconds:.2f} s "
            f"= {hf_rate:,.0f} tok/s; kvrelay best {best:,.0f} tok/s = {best / hf_rate:.1f}x")
    del hf


def capture_piecewise(rep: Report, runner, max_tokens: int, cuda: bool) -> None:
    """Piecewise graphs for the steps with prefill, captured after the other throughput rows (a
    failure loses no other row). On CPU the same segments run uncaptured (the rehearsal)."""
    from kvrelay.engine.runner.piecewise_graphs import PiecewiseGraphs, token_buckets

    if cuda:
        report = runner.capture_piecewise_graphs(max_tokens)
    else:
        runner.piecewise = PiecewiseGraphs(runner.model, runner.kv_cache, token_buckets(max_tokens)[-1])
        report = runner.piecewise.capture(token_buckets(max_tokens), use_graphs=False)
    rep.add("piecewise_capture", vars(report),
            f"piecewise graphs: {report.num_graphs} captured in {report.seconds:.1f} s, "
            f"{report.memory_bytes / 2**20:.0f} MiB")


def section_fp8_engine(rep: Report, bf16_engine, model_dir: Path, reqs, device: str) -> None:
    """--quantization fp8 on the same weights: throughput with graphs, and how many greedy tokens
    agree with the bf16 engine (W8A8 perturbs logits; random weights make near-ties common)."""

    memory = 16 * 2**30 if device == "cuda" else 64 * 2**20
    engine = engine_for(model_dir, device, quantization="fp8", kv_cache_memory=memory, max_num_seqs=256,
                        max_num_batched_tokens=8192)
    generated, seconds = generate_all(engine, reqs, "f")
    prompts = [ids for ids, _ in reqs[:8]]
    a, b = greedy_tokens(bf16_engine, prompts, 16), greedy_tokens(engine, prompts, 16)
    agree = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    rep.add("throughput_fp8", {"tokens": generated, "seconds": seconds, "tok_s": generated / seconds,
                               "greedy_agree": agree},
            f"throughput kvrelay fp8 W8A8, graphs, 8192-token budget: {generated / seconds:,.0f} tok/s; greedy "
            f"tokens agreeing with bf16: {agree}/{sum(map(len, a))}")
    del engine


def section_penalties(rep: Report, device: str, smoke: bool) -> None:
    nrows, vocab, history, repeats = (4, 512, 32, 2) if smoke else (128, 128256, 512, 20)
    for m in measure_penalties(device, nrows, vocab, history, repeats):
        rep.add(f"penalties_{m['kind'].split()[0]}", m,
                f"penalties, {m['kind']}, {nrows} rows of {vocab}: per row {m['per_row_ms']:.2f} ms "
                f"({m['per_row_ops']} ops), batched {m['batched_ms']:.2f} ms ({m['batched_ops']} ops), "
                f"x{m['batched_ms'] / m['per_row_ms']:.3f}")


# ---- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: every section runs, no timing")
    p.add_argument("--only", default="parity,step,throughput,fp8,spec,handoff,handoff_procs,parallel_step,moe,parallel,"
                                        "kernels,penalties")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline (~25 s on an H200)")
    p.add_argument("--handoff-repeats", type=int, default=None,
                   help="measured runs per hand-off row (default 3; 1 with --cpu-smoke)")
    args = p.parse_args(argv)
    smoke = args.cpu_smoke
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is imported
    map_kvrelay()
    import torch

    cuda = torch.cuda.is_available() and not smoke
    if not cuda and not smoke:
        print("no CUDA device: run with --cpu-smoke", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    sections = set(args.only.split(","))
    rep = Report()
    print(f"# {torch.cuda.get_device_name() if cuda else 'CPU smoke run (figures meaningless)'}; torch "
          f"{torch.__version__}; kvrelay from {ROOT}", flush=True)
    failures = []

    def run(name, fn, *a):
        started = time.perf_counter()
        try:
            fn(*a)
        except Exception:  # noqa: BLE001 - one broken section must not cost the others their run
            failures.append(name)
            traceback.print_exc()
        print(f"# section {name}: {time.perf_counter() - started:.1f} s", flush=True)

    if "parity" in sections:
        run("parity", section_parity, rep, device, smoke)
    if sections & {"step", "throughput", "fp8", "spec", "handoff", "handoff_procs", "parallel_step"}:
        config = TINY if smoke else LLAMA_1B
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = make_1b_dir(Path(tmp) / "model", config, device)
            kw = {"max_num_seqs": 256, "max_num_batched_tokens": 2048 if smoke else 8192}
            if smoke:
                kw |= {"kv_cache_memory": 64 * 2**20, "max_num_seqs": 16}
            else:
                kw["gpu_memory_utilization"] = 0.5  # the HF baseline shares the device
            started = time.perf_counter()
            engine = engine_for(model_dir, device, **kw)
            rep.add("engine_start_s", time.perf_counter() - started,
                    f"1B-shape engine ready in {time.perf_counter() - started:.1f} s: {engine.pool.num_blocks} KV "
                    f"blocks; graphs {'captured' if engine.runner.graphs else 'off'}")
            vocab = config["vocab_size"]
            if "step" in sections:
                cases = [(4, 40), (2, 100)] if smoke else [(128, 512), (16, 2048)]
                run("step", section_step, rep, engine, vocab, cases, cuda)
            rng = random.Random(0)
            n = 6 if smoke else args.requests
            prompt_range, out_range = ((4, 40), (2, 8)) if smoke else ((32, 1024), (32, 256))
            reqs = [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))],
                     rng.randint(*out_range)) for _ in range(n)]
            if "throughput" in sections:
                hf_batch = 0 if args.no_hf else 4 if smoke else 32
                run("throughput", section_throughput, rep, engine, model_dir, reqs, hf_batch, cuda)
            if "fp8" in sections:
                run("fp8_engine", section_fp8_engine, rep, engine, model_dir, reqs, device)
            del engine
            repeats = args.handoff_repeats or (1 if smoke else 3)
            if "handoff" in sections:  # before spec: issue 21's targets, if the time runs out
                run("handoff", section_handoff, rep, model_dir, vocab, device, smoke, kw, repeats)
            if "handoff_procs" in sections:
                run("handoff_procs", section_handoff_procs, rep, model_dir, vocab, device, smoke, repeats)
            if "spec" in sections:
                spec_kw = {k: v for k, v in kw.items() if k != "max_num_seqs"}
                run("spec", section_spec, rep, model_dir, vocab, device, smoke, spec_kw)
            if "parallel_step" in sections:
                run("parallel_step", section_parallel_step, rep, model_dir, vocab, device, smoke)
    if "moe" in sections:
        run("moe", section_moe, rep, device, smoke)
    if "parallel" in sections:
        run("parallel", section_parallel, rep, device, smoke)
    if "kernels" in sections:
        run("kernels", section_kernels, rep, smoke)
    if "penalties" in sections:
        run("penalties", section_penalties, rep, device, smoke)

    print("\n# summary")
    for line in rep.lines:
        print(line)
    print(f"# failed sections: {', '.join(failures) or 'none'}")
    rep.save()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
