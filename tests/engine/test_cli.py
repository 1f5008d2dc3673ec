"""`kvrelay generate` from the command line."""

from __future__ import annotations

import json
import subprocess
import sys

STORY_START = "Once upon a time, there was a little girl named Lily."


def kvrelay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", *args], check=False, capture_output=True, text=True, timeout=120
    )


def test_generate_prints_completions_of_several_prompts():
    out = kvrelay("generate", "--max-tokens", "12", "Once upon a time", "Lily liked")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith(STORY_START) and lines[1].startswith("Lily liked")


def test_generate_json_with_seed_is_reproducible():
    args = (
        "generate",
        "--json",
        "--temperature",
        "0.9",
        "--seed",
        "5",
        "--max-tokens",
        "8",
        "The dog",
        "A cat",
    )
    first, second = kvrelay(*args), kvrelay(*args)
    assert first.returncode == 0, first.stderr
    rows = [json.loads(line) for line in first.stdout.splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [8, 8]
    assert first.stdout == second.stdout


def test_generate_bad_input_exits_2_with_a_clear_message():
    out = kvrelay("generate", "--max-tokens", "5000", "x")
    assert out.returncode == 2 and "max_tokens" in out.stderr
    out = kvrelay("generate", "--model", "/nonexistent", "x")
    assert out.returncode == 2 and "/nonexistent" in out.stderr


def test_env_reports_what_a_bug_report_needs():
    out = kvrelay("env", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    import torch

    assert data["kvrelay"] == "0.1.0" and data["python"].startswith(sys.version.split()[0])
    assert data["packages"]["torch"] == torch.__version__
    assert set(data["packages"]) >= {"triton", "transformers", "numpy"}
    assert data["cuda"]["available"] == torch.cuda.is_available()
    assert data["native_cpu_kernels"]["status"] in ("built", "unavailable")
    assert set(data["plugins"]) == {"kvrelay.architectures", "kvrelay.logits_processors", "kvrelay.routing",
                                    "kvrelay.kv_transports", "kvrelay.gateway_hooks"}
    text = kvrelay("env").stdout
    assert "native_cpu_kernels:" in text and "flags:" in text


def test_cli_flags_carry_every_non_default_engine_option():
    """serve --disaggregated rebuilds its workers' engine flags from these: a round trip loses nothing."""
    import argparse

    from kvrelay.engine.engine_args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    argv = ["--dtype", "bfloat16", "--kv-cache-memory", "8MiB", "--no-prefix-caching", "--enable-expert-parallel",
            "-tp", "2", "--no-pipeline-overlap", "--speculative-method", "ngram", "--num-speculative-tokens", "3",
            "--quantization", "int8", "--max-num-seqs", "7"]
    args = parser.parse_args(argv)
    flags = EngineArgs.cli_flags(args)
    assert EngineArgs.from_cli(parser.parse_args(flags)) == EngineArgs.from_cli(args)
    assert "--enable-expert-parallel" in flags and "--no-prefix-caching" in flags
    assert EngineArgs.cli_flags(parser.parse_args([])) == []  # defaults stay implicit
