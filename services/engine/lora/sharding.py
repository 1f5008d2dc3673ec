"""A LoRA adapter cut for one tensor/pipeline-parallel rank, by the same rules as the weights it
adapts (kvrelay.engine.parallel.layers.shard_plan), so no extra communication is needed:

- column-parallel projections (q, k, v, gate, up) split their output rows: the rank keeps B's rows
  of its heads or MLP columns, and all of A;
- row-parallel projections (o_proj, down) split their input columns: the rank keeps A's columns,
  and all of B. Its delta (x_shard @ A_shard^T) @ B^T is then a partial sum like the projection's
  own output, and the all-reduce that follows the projection adds the ranks' parts.

A pipeline stage keeps its own layers, renumbered from 0 as its weights are.
"""

from __future__ import annotations

from kvrelay.engine.lora.adapter import MODULES, LoRAAdapter, LoRAModule, module_shape
from kvrelay.engine.lora.stacked import LoRASet
from kvrelay.engine.model_config import ModelConfig
from kvrelay.engine.parallel.layers import cut, shard_plan, stage_layers
from kvrelay.engine.parallel.state import ParallelState


def shard_adapter(adapter: LoRAAdapter, config: ModelConfig, state: ParallelState) -> LoRAAdapter:
    """adapter (checked against the whole model's config) as rank `state` holds it."""
    start, end = stage_layers(config.num_layers, state.pp_size, state.pp_rank)
    out = LoRAAdapter(adapter.name, adapter.path, adapter.rank)
    for (layer, module), m in adapter.modules.items():
        if not start <= layer < end:
            continue
        block = "self_attn" if MODULES[module][0] in ("qkv", "o_proj") else "mlp"
        name = f"model.layers.{layer}.{block}.{module}.weight"
        plan = shard_plan(name, module_shape(config, module), config, state.tp_rank, state.tp_size)
        a, b = m.a, m.b
        if plan.ranges and plan.dim == 0:
            b = cut(plan, lambda dim, lo, hi, t=b: t[lo:hi], tuple(b.shape)).contiguous()
        elif plan.ranges:
            a = cut(plan, lambda dim, lo, hi, t=a: t[:, lo:hi], tuple(a.shape)).contiguous()
        out.modules[(layer - start, module)] = LoRAModule(a, b)
    return out


def load_rank_lora_set(spec, state: ParallelState, weights, local: ModelConfig) -> LoRASet:
    """A parallel worker's adapters (spec: its WorkerSpec): read whole, checked against the whole
    model, cut to this rank's part and attached to its weights (local: the rank's own config)."""
    from kvrelay.engine.lora import read_adapters

    adapters = read_adapters(list(spec.lora_modules), spec.config, spec.max_lora_rank, spec.dtype)
    adapters = [shard_adapter(a, spec.config, state) for a in adapters]
    lora = LoRASet([a.name for a in adapters])
    lora.attach(weights, local, spec.dtype, adapters)
    return lora
