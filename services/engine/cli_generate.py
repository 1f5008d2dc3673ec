"""`kvrelay generate`: run prompts through the engine (batched) and print completions."""

from __future__ import annotations

import argparse
import json
import sys

from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.errors import EngineError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("prompts", nargs="+", metavar="PROMPT")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (prompt i uses seed + i)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--lora", default=None, metavar="NAME",
                        help="generate with this adapter of --lora-modules (default: the base model)")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object per prompt, with token ids"
    )


def run(args: argparse.Namespace) -> int:
    from kvrelay.engine.llm_engine import LLMEngine
    from kvrelay.engine.sampling_params import SamplingParams

    try:
        engine = LLMEngine(EngineArgs.from_cli(args))
        results = {}
        for i, prompt in enumerate(args.prompts):
            params = SamplingParams(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=None if args.seed is None else args.seed + i,
                stop=list(args.stop),
                lora=args.lora,
            )
            engine.add_request(prompt, params, str(i))
            results[str(i)] = {"prompt": prompt, "text": "", "token_ids": [], "finish_reason": None}
        while engine.has_work():
            for out in engine.step():
                r = results[out.request_id]
                r["text"] += out.text
                r["token_ids"] += out.new_token_ids
                r["finish_reason"] = out.finish_reason
    except (EngineError, ValueError) as e:
        print(f"kvrelay generate: error: {e}", file=sys.stderr)
        return 2
    for r in results.values():
        if args.json:
            print(json.dumps(r))
        else:
            print(r["prompt"] + r["text"])
    return 0
