"""Real PEFT LoRA adapters of a model folder, saved as PEFT saves them, and PEFT's own greedy output
(the numerical reference for kvrelay's adapters)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = (*ATTENTION, "gate_proj", "up_proj", "down_proj")


def save_adapter(model_dir: Path | str, out: Path, targets: tuple[str, ...], r: int, alpha: float, seed: int,
                 use_rslora: bool = False, scale: float = 1.0) -> Path:
    """A random adapter (A and B both random, unlike training's zero B, so it changes the output).
    scale multiplies B: large enough to change greedy tokens, small enough to keep them sensible."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                 init_lora_weights=False, use_rslora=use_rslora, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    peft_model.save_pretrained(str(out))
    return out


@cache
def _peft_model(model_dir: str, adapter_dir: str):
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(model_dir: Path | str, adapter_dir: Path | str, prompt_ids: list[int], n: int) -> list[int]:
    """PEFT's greedy tokens (the adapter unmerged, as PEFT runs it) with HF generate."""
    model = _peft_model(str(model_dir), str(adapter_dir))
    with torch.no_grad():
        seq = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
    return seq[0, len(prompt_ids):].tolist()


def two_adapters(root: Path, model_dir: Path | str) -> dict[str, str]:
    """The tests' pair: "attn" (q/k/v/o, rank 4) and "full" (every projection, rank 8, rsLoRA's
    scale), so that different ranks and targets stack together."""
    return {"attn": str(save_adapter(model_dir, root / "attn", ATTENTION, r=4, alpha=8, seed=1, scale=0.5)),
            "full": str(save_adapter(model_dir, root / "full", ALL_LINEAR, r=8, alpha=16, seed=2, scale=0.3,
                                     use_rslora=True))}
