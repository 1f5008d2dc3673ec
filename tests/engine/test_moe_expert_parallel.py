"""Expert parallelism on 2 gloo processes: each rank loads only its half of the experts and the
ranks' partial outputs are summed, giving the same greedy tokens and logprobs as one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny_model

WORKER = Path(__file__).resolve().parent / "moe_ep_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(model: Path, world: int, tmp_path: Path, quantization: str | None = None) -> list[dict]:
    port = _free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(model), str(r), str(world), str(port),
                          str(tmp_path / f"rank{r}-{world}.json"), *([quantization] if quantization else [])],
                         env=env, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    try:
        for p in procs:
            _, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [json.loads((tmp_path / f"rank{r}-{world}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("arch,quantization", [("mixtral", None), ("qwen2_moe", None), ("mixtral", "int8")])
def test_ep2_equals_ep1_and_each_rank_loads_half_the_experts(tmp_path, arch, quantization):
    model = save_tiny_model(tmp_path / arch, arch)
    (one,) = _run(model, 1, tmp_path, quantization)
    ranks = _run(model, 2, tmp_path, quantization)
    for r, got in enumerate(ranks):
        assert got["tokens"] == one["tokens"], f"rank {r}"
        assert got["experts_held"] == [4, 4] and got["expert_start"] == [4 * r, 4 * r]
        assert got["expert_bytes"] * 2 == one["expert_bytes"]
        # Every rank routes every token (counters cover all experts, not only its own).
        assert got["load_total"] == one["load_total"]
        # int8: per expert, per output channel scales, so a rank's experts quantize as in one process.
        if arch == "mixtral":  # top-2: each sum is a + b on one rank or (a + 0) + (0 + b): exact
            assert got["logprobs"] == one["logprobs"]
        else:  # top-4: the ranks' partial sums associate differently
            for req, rows in got["logprobs"].items():
                for (tok, lp, _), (tok1, lp1, _) in zip(rows, one["logprobs"][req], strict=True):
                    assert tok == tok1 and abs(lp - lp1) <= 1e-4 * max(1.0, abs(lp1))
