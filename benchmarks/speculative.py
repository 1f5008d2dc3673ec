"""Speculative decoding (n-gram prompt lookup, a draft model) against plain decoding, stories260K, in one run.

    .venv/bin/python benchmarks/speculative.py [--tokens 128] [--batches 1,16] [--k 4] [--methods ngram,draft]
        [--draft DIR] [--repeats 3] [--always] [--workloads repeating,open,json]

The draft defaults to stories260K cut to its first 4 of 5 layers (same tokenizer; it agrees with
the target often enough to be accepted, and costs 4/5 of it: on this model it shows the mechanism,
not a speed-up, which needs a draft much cheaper than its target).

Two workloads: "repeating" (prompts that quote a passage and start it again, so the continuation
copies it: the editing / summarising shape where lookup pays) and "open" (plain story openings).
A third, "json", is structured output: the repeating prompts under a JSON schema (an object with a
name and a list of enums; the output ends where the grammar does, EOS then ends it even with
ignore_eos), so proposals are cut to what the grammar accepts and verified under its mask.
Greedy, EOS ignored, so both runs emit exactly the same tokens; the script checks that they do.
Per workload and batch size it prints tokens/s, time per output token, acceptance rate, mean
accepted length, the share of decode steps the throughput controller let speculate, and the ratio
to plain decoding measured in the same run (plain and speculative runs alternate).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
         "she saw a big, red ball. She wanted to play with it, but it was too high. Lily's mom said, \"Let's ask "
         "the man to help us.\" The man was very nice and he got the ball down.")
REPEATING = [STORY + "\n\n" + STORY[:n] for n in (30, 60, 90, 120)]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "toys": {"type": "array", "maxItems": 40, "items": {"enum": ["ball", "doll", "kite"]}}},
          "required": ["name", "toys"], "additionalProperties": False}
# name -> (prompts, JSON schema the output is constrained to, or None)
WORKLOADS = {
    "repeating": (REPEATING, None),
    "open": (["Once upon a time", "Tom and Sue went to the park.", "The little bird", "One day, a big dog"], None),
    "json": (REPEATING, SCHEMA),
}


def median(runs: list[dict]) -> dict:
    """The median run by tokens/s (short runs on a shared machine are noisy)."""
    return sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]


def run_once(prompts: list[str], batch: int, tokens: int, spec: dict, schema: dict | None = None) -> dict:
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.structured.spec import GuidedSpec

    engine = LLMEngine(EngineArgs(**spec))
    structured = GuidedSpec("json", json.dumps(schema)) if schema is not None else None
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, structured=structured)
    engine.add_request(prompts[0], SamplingParams(max_tokens=4, temperature=0.0), "warm-up")
    while engine.has_work():
        engine.step()
    out: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i in range(batch):
        engine.add_request(prompts[i % len(prompts)], params, str(i))
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    seconds = time.perf_counter() - start
    s = engine.stats()
    # Share of the measured decode-only steps that speculated (the controller's choice).
    buckets = engine.speculator.controller._buckets.values() if engine.speculator else []
    on, off = sum(b.samples[True] for b in buckets), sum(b.samples[False] for b in buckets)
    emitted = sum(map(len, out.values()))  # a grammar may end an output before max_tokens
    return {"out": out, "seconds": seconds, "tok_s": emitted / seconds,
            "tpot_ms": seconds / (emitted / batch) * 1e3, "drafts": s.spec_num_drafts,
            "proposed": s.spec_num_draft_tokens, "accepted": s.spec_num_accepted_tokens,
            "spec_steps": on / (on + off) if on + off else 0.0}


def truncated_draft(layers: int = 4) -> str:
    """stories260K's first `layers` layers, in a temporary folder."""
    from safetensors.torch import load_file, save_file

    from kvrelay.models import BUNDLED_MODEL

    dst = Path(tempfile.mkdtemp()) / f"stories260K-{layers}l"
    shutil.copytree(BUNDLED_MODEL, dst)
    config = json.loads((dst / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(dst / "model.safetensors")
    keep = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is reported")
    p.add_argument("--methods", default="ngram,draft")
    p.add_argument("--always", action="store_true", help="--no-speculative-adaptive: speculate in every step")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--draft", default=None, help="the draft model's folder (default: stories260K cut to 4 layers)")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    specs = {}
    for method in args.methods.split(","):
        specs[method] = {"speculative_method": method, "num_speculative_tokens": args.k,
                         "speculative_adaptive": not args.always}
        if method == "draft":
            specs[method]["speculative_model"] = args.draft or truncated_draft()
    print(f"{'workload':<10} {'batch':>5} {'method':>6} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
          f"{'TPOT ms':>13} {'accept':>7} {'mean accepted':>13} {'spec steps':>10} identical")
    for name in args.workloads.split(","):
        prompts, schema = WORKLOADS[name]
        for batch in map(int, args.batches.split(",")):
            # Plain and speculative runs alternate, so that a change in the machine's load hits both.
            runs: dict[str, list[dict]] = {m: [] for m in ["plain", *specs]}
            for _ in range(args.repeats):
                runs["plain"].append(run_once(prompts, batch, args.tokens, {}, schema))
                for method, spec in specs.items():
                    runs[method].append(run_once(prompts, batch, args.tokens, spec, schema))
            plain = median(runs["plain"])
            for method in specs:
                r = median(runs[method])
                rate = r["accepted"] / r["proposed"] if r["proposed"] else 0.0
                mean = r["accepted"] / r["drafts"] if r["drafts"] else 0.0
                print(f"{name:<10} {batch:>5} {method:>6} {plain['tok_s']:>11.0f} {r['tok_s']:>10.0f} "
                      f"{r['tok_s'] / plain['tok_s']:>5.2f}x {plain['tpot_ms']:>6.2f}/{r['tpot_ms']:<6.2f} "
                      f"{rate:>7.2f} {mean:>13.2f} {r['spec_steps']:>10.2f} {plain['out'] == r['out']}", flush=True)

if __name__ == "__main__":
    main()
