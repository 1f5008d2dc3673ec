"""One rank's part of the model, read shard by shard: each checkpoint tensor is sliced in the file
(safetensors `get_slice`), so a rank reads only its columns, rows and layers, never the whole
checkpoint. The architecture's own `assemble` then builds the rank's weights from the slices,
with the stage's layers renumbered from 0."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.model_config import ModelConfig
from kvrelay.engine.parallel.layers import cut, local_config, shard_plan, stage_layers
from kvrelay.engine.parallel.state import ParallelState
from kvrelay.engine.weights import assemble, checkpoint_files, dummy_tensors, expected_shapes
from safetensors import safe_open

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


def stage_names(config: ModelConfig, state: ParallelState) -> dict[str, str]:
    """Checkpoint name -> the name assemble() reads in this stage (layers renumbered from 0), for
    the tensors this stage needs."""
    start, end = stage_layers(config.num_layers, state.pp_size, state.pp_rank)
    out = {}
    for name in expected_shapes(config):
        m = _LAYER.match(name)
        if m:
            n = int(m.group(1))
            if start <= n < end:
                out[name] = f"model.layers.{n - start}." + name[m.end():]
        elif name == _EMBED:
            if state.is_first_stage or (state.is_last_stage and config.tie_word_embeddings):
                out[name] = name
        elif name == _HEAD:
            if state.is_last_stage:
                out[name] = name
        else:
            out[name] = name
    return out


def read_rank_tensors(model_dir: Path, config: ModelConfig, state: ParallelState, dtype: torch.dtype,
                      load_format: str, dummy_seed: int = 0) -> dict[str, torch.Tensor]:
    """This rank's slices, under the names assemble() reads for its stage."""
    shapes = expected_shapes(config)
    names = stage_names(config, state)
    out: dict[str, torch.Tensor] = {}
    if load_format == "dummy":  # the same random tensors as one process, then sliced
        full = dummy_tensors(config, dtype, seed=dummy_seed)
        for name, local in names.items():
            t = full[name]
            plan = shard_plan(name, shapes[name], config, state.tp_rank, state.tp_size)
            out[local] = cut(plan, lambda dim, a, b, t=t: t if dim is None else t.narrow(dim, a, b - a),
                             shapes[name]).clone()
    else:
        model_dir = Path(model_dir)
        files, stored = checkpoint_files(model_dir, names)
        missing = [n for n in names if n not in files]
        if missing:
            raise ModelLoadError(f"{model_dir}: tensor {missing[0]!r} (expected shape {list(shapes[missing[0]])}) "
                                 f"is missing")
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(files[name], []).append(name)
        for path, file_names in sorted(by_file.items()):
            with safe_open(str(path), framework="pt") as st:
                for name in file_names:
                    sl = st.get_slice(stored[name])
                    shape = tuple(sl.get_shape())
                    if shape != shapes[name]:
                        raise ModelLoadError(f"{path.name}: tensor {name!r} has shape {list(shape)}, expected "
                                             f"{list(shapes[name])} from config.json")
                    plan = shard_plan(name, shape, config, state.tp_rank, state.tp_size)
                    out[names[name]] = cut(plan, lambda dim, a, b, sl=sl: _read(sl, dim, a, b), shape).to(dtype)
    # Tensors another stage holds: empty stand-ins, so the architecture's assemble() runs unchanged.
    h = config.hidden_size
    for name in (_EMBED, _HEAD):
        if name in shapes and name not in out:
            out[name] = torch.empty((0, h), dtype=dtype)
    return out


def _read(sl, dim: int | None, start: int, stop: int) -> torch.Tensor:
    if dim is None:
        return sl[:]
    if dim == 0:
        return sl[start:stop]
    return sl[:, start:stop]


def load_rank_weights(model_dir: Path, config: ModelConfig, state: ParallelState, dtype: torch.dtype,
                      device: torch.device, load_format: str, dummy_seed: int = 0):
    """(this rank's ModelWeights, its local ModelConfig)."""
    tensors = read_rank_tensors(model_dir, config, state, dtype, load_format, dummy_seed)
    local = local_config(config, state)
    return assemble(local, {k: v.to(device) for k, v in tensors.items()}), local
