"""save_tiny_model: tiny random HF models of each supported architecture, saved with save_pretrained
(a module of its own: test files import it, and `conftest` is ambiguous when several suites run)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from kvrelay.models import BUNDLED_MODEL

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_tiny_model(path: Path, arch: str, **overrides) -> Path:
    """A randomly initialised tiny model of `arch`, with the bundled tokenizer (vocab 512)."""
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "phi3": transformers.Phi3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }[arch]
    kwargs = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        # Large init so logits are peaked and greedy choices are not near-ties.
        "initializer_range": 1.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    if arch in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = 32
    if arch == "mixtral":
        kwargs.update(num_local_experts=8, num_experts_per_tok=2)
    if arch in ("qwen2_moe", "qwen3_moe"):
        kwargs.update(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=48, norm_topk_prob=True)
    if arch == "qwen2_moe":
        kwargs["shared_expert_intermediate_size"] = 96
    if arch in ("gemma2", "gemma3"):
        # Small head dim and window: prompts plus 48 tokens span several windows.
        kwargs.update(head_dim=16, query_pre_attn_scalar=24, sliding_window=16)
    if arch == "phi3":
        kwargs["pad_token_id"] = 0  # the default, 32000, lies outside the tiny vocabulary
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch in MOE_ARCHS:
        # Routers at init 1.0 give logits of std ~8: top-k picks among experts of probability ~1e-8
        # whose order float rounding decides. Smaller routers make every picked weight count.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                    param.mul_(0.1)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED_MODEL / name, path / name)
    return path
