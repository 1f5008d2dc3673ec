"""Which runner a model gets, and how a pooling model turns hidden states into one vector.

The pooler follows the model folder's sentence-transformers files, as vLLM does: `modules.json`
lists the pipeline (Transformer, Pooling, optionally Normalize) and the Pooling module's
`config.json` names the mode. A folder without them pools the last token and normalizes (what
decoder embedding models do). `--pooler-config '{"pooling_type": "MEAN", "normalize": false}'`
overrides either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from kvrelay.engine.errors import ModelLoadError

RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling flags -> our pooling type; its other modes are refused by name.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True
    # embed: the vector itself; classify: a sequence classifier's label probabilities (its head's
    # logits at the last token, architectures/classify.py), labels by index.
    task: str = "embed"
    labels: tuple[str, ...] = ()
    # Matryoshka models (config.json's is_matryoshka / matryoshka_dimensions) accept a request's
    # `dimensions`; others refuse it. Empty: any size up to the hidden size.
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()


def resolve_runner(requested: str, architectures: list[str]) -> str:
    """auto: a checkpoint of the bare decoder (config.json names `LlamaModel`, `Qwen2Model`, ...: no
    LM head) is an embedding model, a sequence classifier a classification model; anything else
    generates."""
    if requested not in RUNNERS:
        raise ValueError(f"--runner must be one of {', '.join(RUNNERS)}, got {requested!r}")
    if requested != "auto":
        return requested
    first = architectures[0] if architectures else ""
    return "pooling" if first.endswith(("Model", "ForSequenceClassification")) else "generate"


def read_pooler_config(model_dir: Path, raw_config: dict, override: str | None = None) -> PoolerConfig:
    cfg = _from_sentence_transformers(model_dir) or PoolerConfig()
    dims = raw_config.get("matryoshka_dimensions")
    if dims is not None:
        if not isinstance(dims, list) or not all(isinstance(d, int) and d > 0 for d in dims):
            raise ModelLoadError(f"{model_dir / 'config.json'}: matryoshka_dimensions must be a list of positive "
                                 f"integers, got {dims!r}")
        cfg = replace(cfg, matryoshka=True, matryoshka_dimensions=tuple(sorted(set(dims))))
    elif raw_config.get("is_matryoshka") is True:
        cfg = replace(cfg, matryoshka=True)
    return cfg if override is None else _apply_override(cfg, override)


def _apply_override(cfg: PoolerConfig, text: str) -> PoolerConfig:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--pooler-config: not valid JSON ({e})") from e
    unknown = sorted(set(spec) - {"pooling_type", "normalize"}) if isinstance(spec, dict) else None
    if unknown is None:
        raise ValueError("--pooler-config: must be a JSON object such as '{\"pooling_type\": \"LAST\"}'")
    if unknown:
        raise ValueError(f"--pooler-config: unknown key(s) {', '.join(unknown)}; known: pooling_type, normalize")
    kind = spec.get("pooling_type", cfg.pooling_type)
    if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
        raise ValueError(f"--pooler-config: pooling_type must be one of {', '.join(POOLING_TYPES)}, got {kind!r}")
    normalize = spec.get("normalize", cfg.normalize)
    if type(normalize) is not bool:
        raise ValueError(f"--pooler-config: normalize must be true or false, got {normalize!r}")
    return replace(cfg, pooling_type=kind.upper(), normalize=normalize)


def _from_sentence_transformers(model_dir: Path) -> PoolerConfig | None:
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    try:
        modules = json.loads(path.read_text())
        kinds = [(m["type"].rsplit(".", 1)[-1], m.get("path", "")) for m in modules]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{path}: not a sentence-transformers module list ({e})") from e
    for kind, _ in kinds:
        if kind not in _ST_MODULES:
            raise ModelLoadError(f"{path}: the {kind} module is not supported (kvrelay pools with "
                                 f"{', '.join(_ST_MODULES)} only); its vectors would differ from the model's")
    pooling = [p for kind, p in kinds if kind == "Pooling"]
    normalize = any(kind == "Normalize" for kind, _ in kinds)
    if not pooling:
        return PoolerConfig(normalize=normalize)
    st_path = model_dir / pooling[0] / "config.json"
    try:
        st = json.loads(st_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{st_path}: the Pooling module's config cannot be read ({e})") from e
    bad = [k for k in _ST_UNSUPPORTED if st.get(k)]
    if bad:
        raise ModelLoadError(f"{st_path}: {bad[0]} is not supported; kvrelay pools with "
                             f"{', '.join(_ST_MODES)}")
    modes = [kind for key, kind in _ST_MODES.items() if st.get(key)]
    if len(modes) != 1:
        raise ModelLoadError(f"{st_path}: exactly one pooling mode must be set (kvrelay does not concatenate "
                             f"modes), got {modes or 'none'}")
    return PoolerConfig(pooling_type=modes[0], normalize=normalize)


def setup_pooling(args, model_dir: Path, config):
    """(pooler config, or None for a generating engine; model config): checks the runner against
    the architecture and the options a pooling engine cannot serve."""
    from dataclasses import replace as replace_config

    raw = json.loads((model_dir / "config.json").read_text())
    runner = resolve_runner(args.runner, raw.get("architectures") or [])
    bare = config.architecture.endswith("Model")
    classifier = config.num_labels > 0
    if runner == "generate":
        if bare or classifier:
            raise ModelLoadError(f"{model_dir}: config.json names {config.architecture}, a decoder without an LM "
                                 f"head: it serves {'classifications' if classifier else 'embeddings'} "
                                 "(--runner pooling), not generation")
        if args.pooler_config is not None:
            raise ValueError("--pooler-config needs --runner pooling")
        return None, config
    refused = [flag for flag, on in (
        ("--speculative-method", args.speculative_method is not None),
        ("--async-scheduling", args.async_scheduling),
    ) if on]
    if classifier:  # the head is vocabulary-parallel under TP; its labels are not a vocabulary
        refused += [flag for flag, on in (("--tensor-parallel-size > 1", args.tensor_parallel_size > 1),
                                          ("--pipeline-parallel-size > 1", args.pipeline_parallel_size > 1)) if on]
        if args.pooler_config is not None:
            refused.append("--pooler-config (a classifier pools its last token)")
    if refused:
        raise ValueError(f"--runner pooling ({'classification' if classifier else 'embeddings'}) does not combine "
                         f"with {', '.join(refused)}")
    if classifier:  # its head takes the LM head's place: the decoder computes the label logits
        from kvrelay.engine.architectures.classify import labels

        return PoolerConfig(normalize=False, task="classify", labels=labels(raw)), config
    pooler = read_pooler_config(model_dir, raw, args.pooler_config)
    # A pooling model never runs its LM head: tied, its weights are not read (a bare decoder has none).
    return pooler, replace_config(config, tie_word_embeddings=True)
