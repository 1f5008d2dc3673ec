"""LoRA adapters served beside the base model, as vLLM's `--lora-modules NAME=PATH`: a request
names an adapter as its `model`, and each step adds every adapter's delta to its own rows.

adapter.py reads and checks PEFT adapters; sharding.py cuts them for a tensor/pipeline-parallel
rank; stacked.py keeps them stacked per fused projection and plans a step's rows by adapter.
Adapters are loaded at start-up and stay on the device.
"""

from __future__ import annotations

import torch
from kvrelay.engine.lora.adapter import LoRAAdapter, load_adapter, parse_lora_modules
from kvrelay.engine.lora.stacked import LoRASet
from kvrelay.engine.model_config import ModelConfig
from kvrelay.engine.weights import ModelWeights


def lora_names(args) -> LoRASet | None:
    """The adapters' names alone (the driver of parallel workers), checked; None without --lora-modules
    or --enable-lora (which alone serves none until one is loaded at run time, lora/runtime.py)."""
    if args.max_lora_rank < 1:
        raise ValueError(f"--max-lora-rank must be >= 1, got {args.max_lora_rank}")
    if not args.lora_modules and not args.enable_lora:
        return None
    return LoRASet(list(parse_lora_modules(args.lora_modules or [])))


def read_adapters(lora_modules: list[str], config: ModelConfig, max_rank: int, dtype: torch.dtype) -> list[LoRAAdapter]:
    """Every adapter of --lora-modules, read and checked against the whole model's config."""
    return [load_adapter(name, path, config, max_rank, dtype)
            for name, path in parse_lora_modules(lora_modules).items()]


def load_lora_set(args, config: ModelConfig, weights: ModelWeights, dtype: torch.dtype) -> LoRASet | None:
    """The adapters of --lora-modules, attached to weights (one process); None without any."""
    lora = lora_names(args)
    if lora is not None:
        lora.attach(weights, config, dtype, read_adapters(args.lora_modules or [], config, args.max_lora_rank, dtype))
    return lora
