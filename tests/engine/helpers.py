"""Shared helpers for engine tests: run the engine to completion, and HF greedy references."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import torch
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.engine.sampling_params import SamplingParams

PROMPTS = [
    "Once upon a time",
    "Lily",
    "The little bird flew over the big tree and saw a cat who was very hungry and sad. The cat said",
    "Tom and Sue went to the park.",
    "A",
    "One day, a boy named Tim found a shiny red ball in the garden behind his house. He",
]


def run_engine(engine: LLMEngine, requests: dict[str, tuple]) -> dict[str, list[int]]:
    """requests: id -> (prompt, SamplingParams). Returns id -> generated token ids (sample 0)."""
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
    while engine.has_work():
        for o in engine.step():
            if o.index == 0:
                out[o.request_id].extend(o.new_token_ids)
    return out


def greedy(n: int) -> SamplingParams:
    # min_tokens masks EOS exactly as HF's min_new_tokens does, so both run n tokens.
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)


@cache
def _hf_model(model_dir: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@cache
def hf_greedy(model_dir: str, prompt_ids: tuple[int, ...], n: int) -> list[int]:
    model = _hf_model(model_dir)
    with torch.no_grad():
        seq = model.generate(
            torch.tensor([list(prompt_ids)]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return seq[0, len(prompt_ids) :].tolist()


def hf_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return _hf_model(model_dir)(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def make_engine(model: Path | str, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model), **kw))


@contextlib.contextmanager
def serve(log_path: Path, *args: str, timeout: float = 90) -> Iterator[str]:
    """`kvrelay serve ARGS` on a free loopback port, ready; yields its base URL and stops it after."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", "serve", "--port", str(port),
                                 "--log-level", "warning", *args], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                assert proc.poll() is None, Path(log_path).read_text()
                assert time.monotonic() < deadline, f"serve not ready after {timeout} s"
                try:
                    if httpx.get(url + "/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(15)
