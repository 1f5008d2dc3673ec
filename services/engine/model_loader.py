"""The model of a single-process engine: its weights read (or made up), quantized, packed for the
kernels and handed to the architecture's model class. (Under tensor/pipeline parallelism each
worker process loads its own part instead: kvrelay.engine.parallel.loader.)"""

from __future__ import annotations

from pathlib import Path

import torch
from kvrelay.engine import architectures
from kvrelay.engine.lora import load_lora_set
from kvrelay.engine.model import DecoderModel
from kvrelay.engine.model_config import ModelConfig
from kvrelay.engine.weights import assemble, dummy_tensors, pack_linears, quantize_linears, read_tensors
from kvrelay.kernels.registry import KernelOps


def load_model(args, model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               ops: KernelOps, max_model_len: int):
    if args.load_format == "dummy":
        tensors = dummy_tensors(config, dtype, seed=args.dummy_seed)
    elif args.load_format == "auto":
        tensors = read_tensors(model_dir, config, dtype)
    else:
        raise ValueError(f"load format must be 'auto' or 'dummy', got {args.load_format!r}")
    weights = assemble(config, {k: v.to(device) for k, v in tensors.items()})
    if args.quantization == "int8":
        quantize_linears(weights, ops.quantize_int8)
    elif args.quantization == "fp8":
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError("--quantization fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, "
                             "Hopper or newer); use --quantization int8 on this GPU")
        quantize_linears(weights, ops.quantize_fp8)
    elif args.quantization is not None:
        raise ValueError(f"quantization must be None, 'int8' or 'fp8', got {args.quantization!r}")
    pack_linears(weights, ops.prepack_linear)
    adapters = load_lora_set(args, config, weights, dtype)
    build_model = architectures.get(config.architecture).build_model or DecoderModel
    model = build_model(config, weights, ops, max_model_len)
    model.adapters = adapters
    return model
