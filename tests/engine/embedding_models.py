"""Embedding models for the pooling tests: the bare decoder (Qwen3Model, ...) saved with
save_pretrained, plus sentence-transformers' module files, and the transformers reference vectors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from tiny_models import TOKENIZER_FILES

from kvrelay.models import BUNDLED_MODEL

ST_MODES = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}


def write_sentence_transformers(path: Path, mode: str = "LAST", normalize: bool = True,
                                extra_module: str | None = None) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    if extra_module:
        modules.append({"idx": 3, "name": "3", "path": "3_X", "type": f"sentence_transformers.models.{extra_module}"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {flag: flag == ST_MODES.get(mode) for flag in ST_MODES.values()}
    if mode == "MAX":
        flags["pooling_mode_max_tokens"] = True
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))


def _tiny_config(arch: str, **overrides):
    """A tiny random config of arch (llama, qwen2, qwen3) for the bundled tokenizer (vocab 512)."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}[arch]
    kwargs = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "bos_token_id": 1, "eos_token_id": 2, **({"head_dim": 32} if arch == "qwen3" else {})}
    return config_cls(**(kwargs | overrides))


def _save(model, path: Path) -> Path:
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED_MODEL / name, path / name)
    return path


def save_bare_decoder(path: Path, arch: str, **overrides) -> Path:
    """A random tiny `<Arch>Model` (no LM head, names without "model."), with the bundled tokenizer."""
    import transformers

    torch.manual_seed(99)
    model = transformers.AutoModel.from_config(_tiny_config(arch, **overrides), dtype=torch.float32)
    return _save(model, path)


def save_classifier(path: Path, arch: str, num_labels: int, **overrides) -> Path:
    """A random tiny `<Arch>ForSequenceClassification` (a `score` head, no LM head), bundled tokenizer."""
    import transformers

    torch.manual_seed(7)
    config = _tiny_config(arch, pad_token_id=None, num_labels=num_labels, **overrides)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    return _save(model, path)


def hf_class_probs(model_dir: Path | str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' sequence classification, one prompt at a time: softmax of the logits (sigmoid for one label)."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [model(torch.tensor([ids])).logits[0] for ids in prompts]
    return [lg.softmax(-1) if lg.shape[0] > 1 else lg.sigmoid() for lg in logits]


def hf_vectors(model_dir: Path | str, prompts: list[list[int]], mode: str, normalize: bool = True,
               dimensions: int | None = None) -> list[torch.Tensor]:
    """The reference: transformers' last hidden state (after the final norm), pooled, one prompt at a time."""
    import transformers

    model = transformers.AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            h = model(torch.tensor([ids])).last_hidden_state[0]
            v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[mode]
            if dimensions is not None:
                v = v[:dimensions]
            out.append(F.normalize(v, dim=-1) if normalize else v)
    return out
