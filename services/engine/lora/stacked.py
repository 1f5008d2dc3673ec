"""Every loaded adapter's weights, stacked per fused projection, and the per-step delta.

Each fused projection an adapter targets (qkv, o_proj, gate_up, down) gets A [adapters, parts x R,
in] and B [adapters, out, parts x R], R the largest rank: part p of a fused projection (q, k or v;
gate or up) owns rank columns p*R .. p*R + r and its rows of the output, zeros elsewhere. So one
pair of matmuls per adapter in the step adds the deltas of all its parts (S-LoRA's layout, without
the gather kernels: a step's rows are grouped by adapter instead, which is exact and suits few
adapters per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.lora.adapter import MODULES, LoRAAdapter
from kvrelay.engine.model_config import ModelConfig
from kvrelay.engine.sampler import to_device
from kvrelay.engine.weights import ModelWeights


def _layout(config: ModelConfig) -> dict[str, tuple[int, dict[str, tuple[int, int, int]]]]:
    """fused linear -> (its input size, part -> (rank block, first output row, end output row))."""
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {
        "qkv": (h, {"q": (0, 0, q), "k": (1, q, q + kv), "v": (2, q + kv, q + 2 * kv), "qkv": (0, 0, q + 2 * kv)}),
        "o_proj": (q, {"all": (0, 0, h)}),
        "gate_up": (h, {"gate": (0, 0, i), "up": (1, i, 2 * i), "gate_up": (0, 0, 2 * i)}),
        "down": (i, {"all": (0, 0, h)}),
    }


@dataclass
class LoRALinear:
    """The stacked adapters of one fused projection; used[k]: adapter k targets it."""

    a: torch.Tensor  # [adapters, parts x R, in]
    b: torch.Tensor  # [adapters, out, parts x R]
    used: list[bool]

    def add(self, x: torch.Tensor, out: torch.Tensor, plan: list[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
        """out += each planned adapter's delta on its rows (rows None: every row)."""
        for k, rows in plan:
            if not self.used[k]:
                continue
            if rows is None:
                out += (x @ self.a[k].T) @ self.b[k].T
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ self.a[k].T) @ self.b[k].T)
        return out


class LoRASet:
    """The adapters an engine serves. Slot k holds one adapter: its place in every stack, and the
    index a sequence carries (Sequence.lora). A slot keeps its adapter while sequences use it, even
    once it is unloaded (kvrelay.engine.lora.runtime); only then is it reused. (The driver of
    parallel workers keeps only the names: each worker attaches its own shards.)"""

    def __init__(self, names: list[str]):
        self.names: list[str] = list(names)  # slot -> adapter name (an unloaded slot's too)
        self.index = {name: k for k, name in enumerate(self.names)}  # the adapters requests may name
        # slot -> the key that salts its prefix cache: the name, or name@N for the N-th runtime load
        # (a later adapter under an earlier name must not hit the earlier one's K/V)
        self.cache_keys: list[str] = list(self.names)
        self.slots: list[LoRAAdapter | None] = []  # host copies, to restack (one process only)
        self.loads = 0  # adapters loaded at run time so far

    def attach(self, weights: ModelWeights, config: ModelConfig, dtype: torch.dtype,
               adapters: list[LoRAAdapter | None]) -> None:
        """Give every targeted Linear of weights (config: their shapes, a rank's own under tensor
        parallelism) the stacks of adapters, one per slot (None: an empty slot), on the weights'
        device; Linears no adapter targets lose theirs. Raises before changing anything."""
        stacks = self._stacks(weights, config, dtype, adapters)
        for lw in weights.layers:
            for lin in (lw.qkv, lw.o_proj, lw.gate_up, lw.down):
                if lin is not None:
                    lin.lora = None
        for (layer, fused), stack in stacks.items():
            getattr(weights.layers[layer], fused).lora = stack
        self.slots = list(adapters)

    @staticmethod
    def _stacks(weights: ModelWeights, config: ModelConfig, dtype: torch.dtype,
                adapters: list[LoRAAdapter | None]) -> dict[tuple[int, str], LoRALinear]:
        live = [a for a in adapters if a is not None]
        if not live:
            return {}
        layout = _layout(config)
        rank = max(a.rank for a in live)
        targets = sorted({(layer, MODULES[module][0]) for a in live for layer, module in a.modules})
        stacks = {}
        for layer, fused in targets:
            lin = getattr(weights.layers[layer], fused)
            if lin is None:
                raise ModelLoadError(f"LoRA adapters target layer {layer}'s {fused} projection, which this model's "
                                     f"layer does not have (a mixture-of-experts layer): adapters may target "
                                     f"attention only there")
            in_dim, parts = layout[fused]
            blocks = 1 + max(p[0] for p in parts.values())
            out_dim = max(p[2] for p in parts.values())
            a_stack = torch.zeros(len(adapters), blocks * rank, in_dim, dtype=dtype)
            b_stack = torch.zeros(len(adapters), out_dim, blocks * rank, dtype=dtype)
            used = [False] * len(adapters)
            for k, adapter in enumerate(adapters):
                for (li, module), m in (adapter.modules.items() if adapter else ()):
                    if li != layer or MODULES[module][0] != fused:
                        continue
                    block, lo, hi = parts[MODULES[module][1]]
                    r = m.a.shape[0]
                    a_stack[k, block * rank : block * rank + r] = m.a
                    b_stack[k, lo:hi, block * rank : block * rank + r] = m.b
                    used[k] = True
            device = weights.embed.device
            stacks[(layer, fused)] = LoRALinear(a_stack.to(device), b_stack.to(device), used)
        return stacks


def step_plan(token_adapters: np.ndarray, device: torch.device) -> list[tuple[int, torch.Tensor | None]] | None:
    """StepBatch.lora from each row's adapter index (-1: base model): the rows of each adapter, None
    where one adapter has every row (no gather); None when no row has an adapter."""
    plan = []
    for k in np.unique(token_adapters).tolist():
        if k < 0:
            continue
        rows = np.flatnonzero(token_adapters == k)
        plan.append((k, None if len(rows) == len(token_adapters) else to_device(torch.from_numpy(rows), device)))
    return plan or None


def request_counts(adapters: LoRASet | None, scheduler) -> dict[str, dict[str, int]]:
    """EngineStats' lora_running and lora_waiting: distinct requests per adapter name."""
    if adapters is None:
        return {}
    out = {}
    for field_name, seqs in (("lora_running", scheduler.running), ("lora_waiting", scheduler.waiting)):
        requests: dict[str, set[str]] = {name: set() for name in adapters.index}
        for seq in seqs:
            if seq.lora >= 0:
                requests.setdefault(adapters.names[seq.lora], set()).add(seq.request_id)
        out[field_name] = {name: len(ids) for name, ids in requests.items()}
    return out
