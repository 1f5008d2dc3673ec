"""`kvrelay bench throughput --model DIR`: the engine's offline throughput, no HTTP.

All requests are added to one LLMEngine at once and stepped until done (the shape of
`vllm bench throughput`): what the engine can do when the server and the network cost nothing.

    kvrelay bench throughput --model DIR --dataset random --num-prompts 200 \\
        --random-input-len 256 --random-output-len 64
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from kvrelay.bench import datasets
from kvrelay.bench.load import render


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvrelay.engine.engine_args import EngineArgs

    EngineArgs.add_cli_args(p)
    datasets.add_dataset_arguments(p)
    p.add_argument("--input-len", type=int, default=None, help="same as --random-input-len")
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="max_tokens of every request (default: the dataset's lengths)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="stop at EOS (default: every request generates its full length)",
    )
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="time the engine's first steps too (default: one short request runs first, untimed)",
    )
    p.add_argument("--result-file", default=None, help="JSON with the configuration and the figures")


def measure(
    engine,
    prompts: list[list[int]],
    output_lens: list[int | None],
    temperature: float = 0.0,
    ignore_eos: bool = True,
    warmup: bool = True,
) -> dict:
    """Add every request to the engine at once and step until all are done; tokens per second."""
    from kvrelay.engine.sampling_params import SamplingParams

    if warmup:  # one short request first: the first steps build kernels and caches a server pays once
        engine.add_request(prompts[0][:8], SamplingParams(max_tokens=2, temperature=0.0), "warmup")
        while engine.has_work():
            engine.step()
    start = time.perf_counter()
    for i, (ids, n) in enumerate(zip(prompts, output_lens)):
        engine.add_request(
            ids, SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=ignore_eos), str(i)
        )
    generated = finished = 0
    while engine.has_work():
        for out in engine.step():
            generated += len(out.new_token_ids)
            finished += bool(out.finished)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "requests": len(prompts),
        "finished": finished,
        "elapsed_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": generated,
        "request_throughput": len(prompts) / elapsed,
        "total_token_throughput": (prompt_tokens + generated) / elapsed,
        "output_throughput": generated / elapsed,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def run(args: argparse.Namespace) -> int:
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.errors import EngineError
    from kvrelay.engine.llm_engine import LLMEngine

    if args.dataset == "conversation":
        print(
            "kvrelay bench throughput: --dataset conversation needs a server's replies; use bench serve",
            file=sys.stderr,
        )
        return 2
    if args.input_len is not None:
        args.random_input_len = args.input_len
    try:
        engine = LLMEngine(EngineArgs.from_cli(args))
        cfg = datasets.config_from_args(args, args.num_prompts or 100)
        sessions = datasets.load_dataset(cfg, engine.tokenizer)
        prompts, lens = [], []
        for s in sessions:
            text, _ = render(s, 0, [], chat=False)
            ids = engine.tokenizer.encode_prompt(text)[: engine.max_model_len - 1]
            n = args.output_len or s.turns[0].output_len
            lens.append(None if n is None else max(1, min(n, engine.max_model_len - len(ids))))
            prompts.append(ids)
        result = measure(engine, prompts, lens, args.temperature, args.ignore_eos, args.warmup)
    except (ValueError, EngineError) as e:
        print(f"kvrelay bench throughput: {e}", file=sys.stderr)
        return 2
    print(
        f"Throughput: {result['request_throughput']:.2f} requests/s, "
        f"{result['total_token_throughput']:.2f} total tokens/s, "
        f"{result['output_throughput']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {result['prompt_tokens']}")
    print(f"Total num output tokens:  {result['output_tokens']}")
    print(f"Elapsed: {result['elapsed_s']:.2f} s, peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB")
    if args.result_file:
        config = {k: v for k, v in vars(args).items() if k not in ("bench_run", "bench_command", "command")}
        Path(args.result_file).write_text(
            json.dumps({"tool": "kvrelay bench throughput", "config": config, "result": result}, indent=1)
        )
    return 0
