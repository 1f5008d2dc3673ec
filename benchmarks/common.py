"""Helpers shared by the benchmark scripts: a ~30M-parameter Llama folder, workloads, RSS, worker
processes."""

from __future__ import annotations

import json
import random
import resource
from pathlib import Path

# About 30M parameters: 16.4M embedding + 16.4M lm_head are the bulk; 8 layers of 512 wide.
LLAMA_30M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def write_word_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer "t0 t1 ..." so any token id decodes (benchmarks feed token ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2"}))


def make_model_dir(model_dir: Path, config: dict, with_weights: bool) -> Path:
    """config.json + tokenizer; with_weights also saves random HF weights (for HF baselines)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    if with_weights and not (model_dir / "model.safetensors").exists():
        import torch
        import transformers

        torch.manual_seed(0)
        hf_config = transformers.LlamaConfig(
            **{k: v for k, v in config.items() if k not in ("architectures",)}
        )
        model = transformers.LlamaForCausalLM(hf_config)
        model.save_pretrained(model_dir)
    (model_dir / "config.json").write_text(json.dumps(config))
    write_word_tokenizer(model_dir, config["vocab_size"])
    return model_dir


def workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int = 0):
    """n requests of random token ids: [(prompt_ids, max_tokens)]."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(n)
    ]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def stop_process(proc) -> None:
    """SIGTERM, then SIGKILL if the process is still there after 10 s."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcess:
    """A `kvrelay prefill|decode` process (cmd) whose /metrics is on metrics_port: wait_ready() reads
    its output until it listens (start several first, then wait for each), then drains it in a thread."""

    def __init__(self, cmd: list[str], metrics_port: int, env: dict | None = None):
        import subprocess

        self.role, self.metrics_port = cmd[cmd.index("kvrelay.cli") + 1], metrics_port
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []

    def wait_ready(self, timeout_s: float = 600) -> None:
        import re
        import threading
        import time

        deadline = time.monotonic() + timeout_s
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"kvrelay \w+ listening on ([\d.]+):(\d+)", line)
            if m:
                self.addr = f"{m.group(1)}:{m.group(2)}"
                threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
                return
            if time.monotonic() > deadline:
                break
        stop_process(self.proc)
        raise RuntimeError(f"{self.role} worker did not start:\n{''.join(self.lines[-30:])}")

    def metric(self, name: str, labels: str = "") -> float:
        """A sample of its /metrics page (`name{labels}`); 0 if absent."""
        import urllib.request

        key = f"{name}{{{labels}}}" if labels else name
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(key + " "):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        stop_process(self.proc)


def prefill_all(engine, nseq: int, ctx: int, extra: int, vocab: int, seed: int) -> None:
    """nseq requests of ctx random prompt tokens, each to generate extra more (EOS ignored), stepped
    until every prompt is computed: the engine is then decode-only."""
    from kvrelay.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    for i in range(nseq):
        ids = [rng.randrange(3, vocab) for _ in range(ctx)]
        engine.add_request(ids, SamplingParams(max_tokens=extra, temperature=0.0, ignore_eos=True), f"s{i}")
    while engine.scheduler.waiting or any(s.num_computed < s.prompt_len for s in engine.scheduler.running):
        engine.step()
