"""What mixture-of-experts families share: the MoE fields of config.json, the checkpoint names of a
sparse layer's router, experts and shared expert, and their assembly into MoEWeights.

A sparse layer replaces the gated MLP of the Llama layout with
  router (gate [E, H]) -> softmax in fp32 -> top-k (renormalised when norm_topk_prob)
  -> sum over the k chosen experts of weight * expert(x)     (kvrelay.kernels fused_moe)
  (+ sigmoid(shared_expert_gate(x)) * shared_expert(x), Qwen2-MoE)
Under expert parallelism a rank reads only its experts' tensors (kvrelay.engine.parallel.expert).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.model_config import ModelConfig
from kvrelay.engine.parallel.expert import local_experts
from kvrelay.engine.weights import Linear

# A sparse layer's checkpoint tensors: router, experts, shared expert and its gate.
_MOE_TENSOR = re.compile(
    r"^model\.layers\.\d+\.(block_sparse_moe|mlp)\."
    r"(gate|experts\.\d+\.\w+|shared_expert\.\w+|shared_expert_gate)\.weight$"
)


def is_moe_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a sparse layer. Under tensor parallelism these are read
    whole: the router and the shared expert are replicated, and the expert list already holds only
    this rank's experts when experts are parallel (replicated on every rank when not)."""
    return _MOE_TENSOR.match(name) is not None


# Router kinds config.json may name (DeepSeek-style `scoring_func`, `topk_method`, grouped
# routing); only softmax then greedy top-k is built.
ROUTER_KEYS = {"scoring_func": ("softmax",), "topk_method": ("greedy",), "router_type": ("softmax",)}


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: an MoE block (True) or the dense MLP
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    # Checkpoint names: model.layers.{n}.{block}.gate.weight, ...{block}.experts.{e}.{name}.weight
    block: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down


def parse_moe(
    raw: dict,
    source: str,
    arch: str,
    num_layers: int,
    *,
    norm_topk_prob: bool,
    sparse_step: bool,
    block: str = "mlp",
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    shared: bool = False,
) -> MoEConfig:
    """The MoE fields, validated. sparse_step: the layer pattern comes from `decoder_sparse_step` and
    `mlp_only_layers` (Qwen); otherwise every layer is sparse (Mixtral)."""
    for key, supported in ROUTER_KEYS.items():
        if raw.get(key) is not None and raw[key] not in supported:
            raise ModelLoadError(
                f"{source}: router {key}={raw[key]!r} unsupported for {arch}; supported: softmax then greedy top-k"
            )
    if (raw.get("n_group") or 1) > 1 or (raw.get("topk_group") or 1) > 1:
        raise ModelLoadError(f"{source}: grouped expert routing (n_group/topk_group) unsupported for {arch}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act {raw['hidden_act']!r} unsupported for {arch}; supported: silu")
    num_experts = raw.get("num_local_experts") or raw.get("num_experts")
    if not num_experts:
        raise ModelLoadError(f"{source}: missing required field 'num_local_experts' / 'num_experts' for {arch}")
    num_experts = int(num_experts)
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if not 1 <= top_k <= num_experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}")
    expert_size = int(raw.get("moe_intermediate_size") or raw["intermediate_size"])
    if sparse_step:
        step = int(raw.get("decoder_sparse_step") or 1)
        dense_only = set(raw.get("mlp_only_layers") or [])
        layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))
    else:
        layers = (True,) * num_layers
    shared_size = int(raw.get("shared_expert_intermediate_size") or 0) if shared else 0
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=expert_size,
        norm_topk_prob=norm_topk_prob,
        sparse_layers=layers,
        shared_expert_intermediate_size=shared_size,
        block=block,
        expert_names=expert_names,
    )


@dataclass
class MoEWeights:
    """One sparse layer. Experts [expert_start, expert_start + E_local) of num_experts are here."""

    router: torch.Tensor  # [num_experts, H]: every rank routes every token
    w13: torch.Tensor  # [E_local, 2I, H]: gate rows then up rows
    w2: torch.Tensor  # [E_local, H, I]
    expert_start: int
    num_experts: int
    w13_scale: torch.Tensor | None = None  # [E_local, 2I] when the experts are int8 or fp8
    w2_scale: torch.Tensor | None = None  # [E_local, H]
    shared_gate_up: Linear | None = None
    shared_down: Linear | None = None
    shared_gate: torch.Tensor | None = None  # [1, H]: sigmoid gate on the shared expert

    def linears(self) -> list[Linear]:
        return [lin for lin in (self.shared_gate_up, self.shared_down) if lin is not None]

    def quantize_experts(self, quantize) -> None:
        """Per expert, per output channel int8 or float8_e4m3fn (the kernel op quantize_int8 or
        quantize_fp8, over the experts' rows: one row is one output channel of one expert)."""
        w13_q, s13 = quantize(self.w13.reshape(-1, self.w13.shape[-1]))
        w2_q, s2 = quantize(self.w2.reshape(-1, self.w2.shape[-1]))
        e = self.w13.shape[0]
        self.w13, self.w13_scale = w13_q.view(self.w13.shape), s13.view(e, -1)
        self.w2, self.w2_scale = w2_q.view(self.w2.shape), s2.view(e, -1)

    def expert_bytes(self) -> int:
        """Bytes of the experts this rank holds (the routed ones; router and shared expert excluded)."""
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2, self.w13_scale, self.w2_scale)
                   if t is not None)


def moe_shapes(config: ModelConfig, n: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape for sparse layer n: the router, this rank's experts, the shared expert."""
    moe: MoEConfig = config.moe
    h, i = config.hidden_size, moe.expert_intermediate_size
    p = f"model.layers.{n}.{moe.block}."
    gate, up, down = moe.expert_names
    shapes = {p + "gate.weight": (moe.num_experts, h)}
    for e in local_experts(moe.num_experts):
        shapes[p + f"experts.{e}.{gate}.weight"] = (i, h)
        shapes[p + f"experts.{e}.{up}.weight"] = (i, h)
        shapes[p + f"experts.{e}.{down}.weight"] = (h, i)
    s = moe.shared_expert_intermediate_size
    if s:
        shapes[p + "shared_expert.gate_proj.weight"] = (s, h)
        shapes[p + "shared_expert.up_proj.weight"] = (s, h)
        shapes[p + "shared_expert.down_proj.weight"] = (h, s)
        shapes[p + "shared_expert_gate.weight"] = (1, h)
    return shapes


def expected_shapes(config: ModelConfig, dense_shapes) -> dict[str, tuple[int, ...]]:
    """The dense layout's names (dense_shapes(config)) with each sparse layer's MLP swapped for its MoE."""
    shapes = dense_shapes(config)
    for n, sparse in enumerate(config.moe.sparse_layers):
        if sparse:
            for name in ("gate_proj", "up_proj", "down_proj"):
                del shapes[f"model.layers.{n}.mlp.{name}.weight"]
            shapes.update(moe_shapes(config, n))
    return shapes


def assemble_moe(config: ModelConfig, t: dict[str, torch.Tensor], n: int) -> MoEWeights:
    moe: MoEConfig = config.moe
    p = f"model.layers.{n}.{moe.block}."
    gate, up, down = moe.expert_names
    mine = local_experts(moe.num_experts)
    w13 = torch.stack([torch.cat([t[p + f"experts.{e}.{gate}.weight"], t[p + f"experts.{e}.{up}.weight"]])
                       for e in mine])
    w2 = torch.stack([t[p + f"experts.{e}.{down}.weight"] for e in mine])
    weights = MoEWeights(router=t[p + "gate.weight"], w13=w13, w2=w2, expert_start=mine.start,
                         num_experts=moe.num_experts)
    if moe.shared_expert_intermediate_size:
        s = p + "shared_expert."
        weights.shared_gate_up = Linear(torch.cat([t[s + "gate_proj.weight"], t[s + "up_proj.weight"]]))
        weights.shared_down = Linear(t[s + "down_proj.weight"])
        weights.shared_gate = t[p + "shared_expert_gate.weight"]
    return weights


def assemble(config: ModelConfig, t: dict[str, torch.Tensor], dense_assemble):
    """dense_assemble (the Llama layout's) for attention, norms and dense layers; MoEWeights for the
    sparse layers, whose dense MLP entries stay None."""
    h = config.hidden_size
    t = dict(t)
    sparse = [n for n, s in enumerate(config.moe.sparse_layers) if s]
    empty = torch.empty((0, h), dtype=t["model.norm.weight"].dtype, device=t["model.norm.weight"].device)
    for n in sparse:  # stand-ins the dense assembly reads and we then drop: no copy of real weights
        for name in ("gate_proj", "up_proj", "down_proj"):
            t[f"model.layers.{n}.mlp.{name}.weight"] = empty
    weights = dense_assemble(config, t)
    for n in sparse:
        layer = weights.layers[n]
        layer.gate_up = layer.down = None
        layer.moe = assemble_moe(config, t, n)
    return weights
