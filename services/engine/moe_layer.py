"""The decoder with mixture-of-experts blocks: routing in fp32, the experts through the kernels'
fused_moe, the ranks' partial outputs summed under expert parallelism, and expert load counters."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvrelay.engine.model import DecoderModel
from kvrelay.engine.model_config import ModelConfig
from kvrelay.engine.parallel.expert import ep_all_reduce
from kvrelay.engine.weights import LayerWeights, ModelWeights
from kvrelay.kernels.registry import KernelOps


@dataclass(frozen=True)
class ExpertLoad:
    """Routed tokens per expert (summed over the sparse layers): in the last forward step, and since
    start. imbalance: the busiest expert's tokens over the mean, the worst sparse layer's (1.0 is
    perfectly even; num_experts / top_k when every token picks the same experts)."""

    last_step: list[int]
    total: list[int]
    last_step_imbalance: float
    total_imbalance: float
    steps: int


def _imbalance(per_layer: torch.Tensor) -> float:
    mean = per_layer.float().mean(dim=1)
    ratio = per_layer.float().amax(dim=1) / mean.clamp(min=1e-9)
    return float(ratio[mean > 0].max()) if bool((mean > 0).any()) else 0.0


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights [T, k] fp32, expert ids [T, k]): logits, softmax and top-k in fp32, so the choice
    does not depend on the activations' dtype rounding."""
    logits = F.linear(x.float(), router.float())
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoEDecoderModel(DecoderModel):
    """DecoderModel whose sparse layers run an MoE block instead of the gated MLP."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, ops: KernelOps, max_positions: int, **kw):
        super().__init__(config, weights, ops, max_positions, **kw)  # kw: what DecoderModel takes besides
        moe = config.moe
        self.sparse_index = {}  # layer index -> row of the load counters
        for n, sparse in enumerate(moe.sparse_layers):
            if sparse:
                self.sparse_index[n] = len(self.sparse_index)
        for lw in weights.layers:  # routing is fp32: convert the routers once, not every step
            if lw.moe is not None:
                lw.moe.router = lw.moe.router.float()
        device = weights.embed.device
        # In-place device counters: no host read per step (CUDA graphs replay the adds).
        self.step_tokens = torch.zeros((len(self.sparse_index), moe.num_experts), dtype=torch.int64, device=device)
        self.total_tokens = torch.zeros_like(self.step_tokens)
        self.steps = torch.zeros((), dtype=torch.int64, device=device)
        # bool [T]: the step's real rows (a graph's padding rows route too, but are not counted);
        # None: every row (a pipeline stage runs its layers without begin_step).
        self.real_rows: torch.Tensor | None = None

    def begin_step(self, slot_mapping: torch.Tensor) -> None:
        self.step_tokens.zero_()
        self.steps += 1  # a device tensor: counts graph replays too
        self.mark_rows(slot_mapping)

    def mark_rows(self, slot_mapping: torch.Tensor) -> None:
        self.real_rows = slot_mapping >= 0

    def end_step(self) -> None:
        self.total_tokens += self.step_tokens
        self.real_rows = None

    def mlp(self, layer_idx: int, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        m = lw.moe
        if m is None:
            return super().mlp(layer_idx, lw, x)
        cfg = self.config.moe
        weights, ids = route(x, m.router, cfg.top_k, cfg.norm_topk_prob)
        row = self.step_tokens[self.sparse_index[layer_idx]]
        ones = torch.ones_like(ids) if self.real_rows is None else self.real_rows[:, None].expand_as(ids).long()
        row.scatter_add_(0, ids.reshape(-1), ones.reshape(-1))
        local_ids = ids - m.expert_start if m.expert_start else ids  # other ranks' experts fall outside
        out = self.ops.fused_moe(x, m.w13, m.w2, weights, local_ids, m.w13_scale, m.w2_scale)
        out = ep_all_reduce(out)
        if m.shared_gate_up is not None:
            shared = self._linear(self.act(self._linear(x, m.shared_gate_up)), m.shared_down)
            out = out + torch.sigmoid(F.linear(x, m.shared_gate)) * shared
        return out

    def reset_expert_load(self) -> None:
        """Zero the counters in place (captured CUDA graphs keep adding into the same buffers)."""
        for t in (self.step_tokens, self.total_tokens, self.steps):
            t.zero_()

    def expert_load(self) -> ExpertLoad:
        """The load counters, read from the device (on demand only: a host sync)."""
        step, total = self.step_tokens.cpu(), self.total_tokens.cpu()
        return ExpertLoad(
            last_step=step.sum(dim=0).tolist(),
            total=total.sum(dim=0).tolist(),
            last_step_imbalance=_imbalance(step),
            total_imbalance=_imbalance(total),
            steps=int(self.steps),
        )

    def expert_bytes(self) -> int:
        """Bytes of routed-expert weights held by this rank."""
        return sum(lw.moe.expert_bytes() for lw in self.w.layers if lw.moe is not None)
