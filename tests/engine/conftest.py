"""Fixtures: tiny random HF models of each supported architecture, saved with save_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        "llama": save_tiny_model(root / "llama", "llama"),
        "llama_linear_rope": save_tiny_model(
            root / "llama_linear_rope", "llama", rope_scaling={"rope_type": "linear", "factor": 2.0}
        ),
        "llama3_rope_tied": save_tiny_model(
            root / "llama3_rope_tied",
            "llama",
            tie_word_embeddings=True,
            head_dim=32,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "mistral": save_tiny_model(root / "mistral", "mistral"),
        "qwen2": save_tiny_model(root / "qwen2", "qwen2"),
        "qwen3": save_tiny_model(root / "qwen3", "qwen3"),
    }
