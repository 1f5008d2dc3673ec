"""Mixture of experts on CPU: the fused_moe op against a per-expert mask loop, and kvrelay's
throughput on a ~50M-parameter Mixtral (8 experts, top-2, random weights, fp32) against HF generate.

    .venv/bin/python benchmarks/moe.py [--requests 16] [--hf-seq-requests 4] [--hf-batch 8] [--repeats 5]

On CPU the engine's fused_moe is the torch reference (tokens sorted by expert, one gather and two
GEMMs per expert that got tokens); the Triton kernel's GPU figures come from benchmarks/kernels_gpu.py.
Each throughput system runs in its own subprocess; the kernel timings are the best of --repeats.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import peak_rss_mib, workload, write_word_tokenizer

MIXTRAL_50M = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 8000,
    "hidden_size": 512,
    "intermediate_size": 768,  # per expert
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def make_moe_dir(model_dir: Path) -> tuple[Path, int]:
    import torch
    import transformers

    model_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    hf_config = transformers.MixtralConfig(**{k: v for k, v in MIXTRAL_50M.items() if k != "architectures"})
    model = transformers.MixtralForCausalLM(hf_config)
    if not (model_dir / "model.safetensors").exists():
        model.save_pretrained(model_dir)
    (model_dir / "config.json").write_text(json.dumps(MIXTRAL_50M))
    write_word_tokenizer(model_dir, MIXTRAL_50M["vocab_size"])
    return model_dir, sum(p.numel() for p in model.parameters())


def _best_of(fn, args: tuple, repeats: int) -> float:
    fn(*args)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)  # best of: the machine is shared, contention only adds time


def bench_kernel(repeats: int) -> None:
    import torch
    from kvrelay.kernels.moe_reference import fused_moe, fused_moe_per_expert_loop

    h, i, e, k = MIXTRAL_50M["hidden_size"], MIXTRAL_50M["intermediate_size"], 8, 2
    w13 = torch.randn((e, 2 * i, h)) * h**-0.5
    w2 = torch.randn((e, h, i)) * i**-0.5
    for tokens in (1, 16, 512):
        x = torch.randn((tokens, h))
        w, ids = torch.randn((tokens, e)).softmax(-1).topk(k, dim=-1)

        args = (x, w13, w2, w, ids)
        fused, loop = _best_of(fused_moe, args, repeats), _best_of(fused_moe_per_expert_loop, args, repeats)
        torch.testing.assert_close(fused_moe(x, w13, w2, w, ids), fused_moe_per_expert_loop(x, w13, w2, w, ids),
                                   atol=1e-4, rtol=1e-4)
        print(f"fused_moe {tokens:4d} tokens: {fused * 1e3:7.2f} ms   per-expert loop {loop * 1e3:7.2f} ms   "
              f"speed-up {loop / fused:.2f}x")


def child(args) -> None:
    import torch
    from throughput import run_hf_batched, run_hf_sequential, run_kvrelay

    torch.set_num_threads(args.threads)
    reqs = workload(args.requests, (32, 256), (32, 128), MIXTRAL_50M["vocab_size"])
    if args.mode == "kvrelay":
        result = run_kvrelay(args.model_dir, reqs)
    elif args.mode == "hf-seq":
        result = run_hf_sequential(args.model_dir, reqs[: args.hf_seq_requests])
    else:
        result = run_hf_batched(args.model_dir, reqs, args.hf_batch)
    result["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--hf-seq-requests", type=int, default=4)
    p.add_argument("--hf-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--kernel-only", action="store_true", help="skip the throughput comparison")
    p.add_argument("--mode", choices=["kvrelay", "hf-seq", "hf-batch"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        return child(args)
    import torch

    torch.set_num_threads(args.threads)
    bench_kernel(args.repeats)
    if args.kernel_only:
        return None
    model_dir, params = make_moe_dir(Path(tempfile.gettempdir()) / "kvrelay-bench-mixtral50m")
    print(f"Mixtral-shaped model: {params / 1e6:.1f}M parameters, 8 experts, top-2, fp32")
    rates = {}
    for mode in ("kvrelay", "hf-seq", "hf-batch"):
        cmd = [sys.executable, __file__, "--mode", mode, "--model-dir", str(model_dir), "--threads", str(args.threads)]
        cmd += ["--requests", str(args.requests), "--hf-seq-requests", str(args.hf_seq_requests)]
        cmd += ["--hf-batch", str(args.hf_batch)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rates[mode] = r["tokens"] / r["seconds"]
        print(f"{mode:9s} {r['tokens']:6d} tokens in {r['seconds']:7.1f} s = {rates[mode]:8.1f} tok/s"
              f"   peak RSS {r['peak_rss_mib']:.0f} MiB")
    print(f"kvrelay / HF sequential: {rates['kvrelay'] / rates['hf-seq']:.2f}x   "
          f"kvrelay / HF static batches of {args.hf_batch}: {rates['kvrelay'] / rates['hf-batch']:.2f}x")


if __name__ == "__main__":
    main()
