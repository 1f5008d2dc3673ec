"""LoRA adapters served beside the base model, as vLLM's `--lora-modules NAME=PATH`: a request
names an adapter as its `model`, and each step adds every adapter's delta to its own rows.

adapter.py reads and checks PEFT adapters; stacked.py keeps them stacked per fused projection and
plans a step's rows by adapter. Adapters are loaded at start-up and stay on the device.
"""

from __future__ import annotations

import torch
from kvrelay.engine.lora.adapter import load_adapter, parse_lora_modules
from kvrelay.engine.lora.stacked import LoRASet
from kvrelay.engine.model_config import ModelConfig
from kvrelay.engine.weights import ModelWeights


def check_lora_args(args) -> None:
    """One clear error for flag combinations the adapters do not support."""
    if args.enable_lora and not args.lora_modules:
        raise ValueError("--enable-lora: name the adapters with --lora-modules NAME=PATH (adapters are loaded "
                         "at start-up; loading them at run time is not supported)")
    if args.lora_modules and args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        raise ValueError("--lora-modules is not supported with tensor or pipeline parallelism yet")
    if args.lora_modules and args.distributed_executor_backend == "mp":
        raise ValueError("--lora-modules needs the model in the engine's process (--distributed-executor-backend uni)")
    if args.max_lora_rank < 1:
        raise ValueError(f"--max-lora-rank must be >= 1, got {args.max_lora_rank}")


def load_lora_set(args, config: ModelConfig, weights: ModelWeights, dtype: torch.dtype) -> LoRASet | None:
    """The adapters of --lora-modules, attached to weights; None without any."""
    check_lora_args(args)
    if not args.lora_modules:
        return None
    paths = parse_lora_modules(args.lora_modules)
    adapters = [load_adapter(name, path, config, args.max_lora_rank, dtype) for name, path in paths.items()]
    lora = LoRASet(adapters)
    lora.attach(weights, config, dtype)
    return lora
