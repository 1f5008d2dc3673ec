"""Tensor- and pipeline-parallel layout of the decoder: which slice of each checkpoint tensor a
rank holds, the rank's own config (its heads, its MLP columns, its layers), and the two layers
that need communication besides the row-parallel all-reduce: the vocabulary-parallel embedding
and LM head.

Column-parallel (q/k/v, gate/up: split by output rows), row-parallel (o_proj, down: split by
input columns, partial sums all-reduced), vocabulary-parallel (embedding, LM head: split by
vocabulary rows, padded to a multiple of the TP size). KV heads are split like query heads;
when there are fewer KV heads than ranks each is replicated on tp_size / num_kv_heads ranks
(as vLLM does), so a rank's query heads always find their KV head locally.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from kvrelay.engine.model_config import ModelConfig
from kvrelay.engine.parallel.state import ParallelState, tp_all_reduce

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass
class CommStats:
    """Communication of this process since the last take(): seconds and bytes per kind
    (all_reduce, all_gather, send_recv). On CUDA the seconds are launch time only (NCCL is
    asynchronous); on CPU (gloo) they are the whole collective."""

    seconds: dict[str, float] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, x: torch.Tensor, started: float, count: int = 1) -> None:
        """count tensors of x's size moved since started."""
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - started
        self.nbytes[kind] = self.nbytes.get(kind, 0) + count * x.numel() * x.element_size()

    def take(self) -> dict[str, tuple[float, int]]:
        out = {k: (self.seconds[k], self.nbytes[k]) for k in self.seconds}
        self.seconds, self.nbytes = {}, {}
        return out


COMM = CommStats()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """tp_all_reduce, counted in COMM."""
    started = time.perf_counter()
    tp_all_reduce(x)
    COMM.add("all_reduce", x, started)
    return x


def check_parallel(config: ModelConfig, tp: int, pp: int) -> None:
    """One clear error when the model cannot be split this way."""
    if tp < 1 or pp < 1:
        raise ValueError(f"--tensor-parallel-size ({tp}) and --pipeline-parallel-size ({pp}) must be >= 1")
    if config.num_heads % tp:
        raise ValueError(f"--tensor-parallel-size {tp}: the model's {config.num_heads} attention heads are not "
                         f"divisible by it")
    kv = config.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"--tensor-parallel-size {tp}: the model's {kv} KV heads neither divide nor are "
                         f"divisible by it")
    if config.intermediate_size % tp:
        raise ValueError(f"--tensor-parallel-size {tp}: intermediate_size {config.intermediate_size} is not "
                         f"divisible by it")
    if pp > config.num_layers:
        raise ValueError(f"--pipeline-parallel-size {pp} exceeds the model's {config.num_layers} layers")


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of the contiguous layers of stage pp_rank; earlier stages take the remainder
    (the last stage also runs the LM head)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    return max(1, num_kv_heads // tp_size)


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads rank tp_rank holds: its share, or the one head it replicates."""
    if num_kv_heads >= tp_size:
        n = num_kv_heads // tp_size
        return tp_rank * n, (tp_rank + 1) * n
    head = tp_rank // (tp_size // num_kv_heads)
    return head, head + 1


def vocab_rows(vocab_size: int, tp_size: int) -> int:
    """Rows of the embedding / LM head per rank (the last rank's are padded with zeros)."""
    return -(-vocab_size // tp_size)


def local_config(config: ModelConfig, state: ParallelState) -> ModelConfig:
    """The config of this rank's part of the model: its heads, its MLP columns, its layers."""
    tp = state.tp_size
    start, end = stage_layers(config.num_layers, state.pp_size, state.pp_rank)
    windows = config.layer_windows[start:end] if config.layer_windows else ()
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // tp,
        num_kv_heads=local_kv_heads(config.num_kv_heads, tp),
        intermediate_size=config.intermediate_size // tp,
        num_layers=end - start,
        layer_windows=windows,
    )


@dataclass(frozen=True)
class ShardPlan:
    """How a rank's tensor is cut from the checkpoint's: the [start, stop) ranges along dim,
    concatenated; padded with zero rows to pad_rows; zeros: the rank holds zeros (a row-parallel
    bias is added by rank 0 only)."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()  # empty: the whole tensor (replicated)
    pad_rows: int | None = None
    zeros: bool = False


def shard_plan(name: str, shape: tuple[int, ...], config: ModelConfig, tp_rank: int, tp_size: int) -> ShardPlan:
    """The slice of checkpoint tensor `name` (full shape `shape`) that TP rank tp_rank holds."""
    from kvrelay.engine.architectures.moe import is_moe_tensor  # here: architectures import the model

    if tp_size == 1 or is_moe_tensor(name):  # routers, experts, shared experts: read whole (see is_moe_tensor)
        return ShardPlan()
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = vocab_rows(config.vocab_size, tp_size)
        start = min(tp_rank * rows, config.vocab_size)
        return ShardPlan(0, ((start, min(start + rows, config.vocab_size)),), pad_rows=rows)
    m = _LAYER.match(name)
    part = m.group(2) if m else name
    d = config.head_dim
    qh = config.num_heads // tp_size
    q_rows = (tp_rank * qh * d, (tp_rank + 1) * qh * d)
    k0, k1 = kv_head_range(config.num_kv_heads, tp_size, tp_rank)
    kv_rows = (k0 * d, k1 * d)
    i_cols = config.intermediate_size // tp_size
    i_rows = (tp_rank * i_cols, (tp_rank + 1) * i_cols)
    kind = part.rsplit(".", 1)[0]
    if kind == "self_attn.q_proj":
        return ShardPlan(0, (q_rows,))
    if kind in ("self_attn.k_proj", "self_attn.v_proj"):
        return ShardPlan(0, (kv_rows,))
    if kind in ("mlp.gate_proj", "mlp.up_proj"):
        return ShardPlan(0, (i_rows,))
    if kind == "self_attn.qkv_proj":  # fused [q; k; v] (Phi-3)
        q, kv = config.q_size, config.kv_size
        return ShardPlan(0, (q_rows, (q + kv_rows[0], q + kv_rows[1]), (q + kv + kv_rows[0], q + kv + kv_rows[1])))
    if kind == "mlp.gate_up_proj":  # fused [gate; up] (Phi-3)
        i = config.intermediate_size
        return ShardPlan(0, (i_rows, (i + i_rows[0], i + i_rows[1])))
    if kind in ("self_attn.o_proj", "mlp.down_proj"):
        if part.endswith(".bias"):
            return ShardPlan(zeros=tp_rank != 0)
        cols = q_rows if kind == "self_attn.o_proj" else i_rows
        return ShardPlan(1, (cols,))
    if len(shape) == 1 and part.endswith("norm.weight"):
        return ShardPlan()  # norms over the hidden size or a head's dim: every rank needs all of it
    raise ValueError(f"{config.architecture}: no tensor-parallel rule for checkpoint tensor {name!r} "
                     f"(shape {list(shape)}); run it with --tensor-parallel-size 1")


def cut(plan: ShardPlan, read, shape: tuple[int, ...]) -> torch.Tensor:
    """The rank's tensor: read(dim, start, stop) returns that slice of the checkpoint tensor (lazily
    from the file, or from a tensor in memory); read(None, 0, 0) the whole tensor."""
    if plan.zeros:
        return torch.zeros_like(read(None, 0, 0))
    if not plan.ranges:
        return read(None, 0, 0)
    parts = [read(plan.dim, a, b) for a, b in plan.ranges]
    t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=plan.dim)
    if plan.pad_rows is not None and t.shape[0] < plan.pad_rows:
        t = torch.cat([t, t.new_zeros((plan.pad_rows - t.shape[0], *t.shape[1:]))])
    return t


def quantize_rank_linears(weights, quantize, state: ParallelState) -> None:
    """Quantize this rank's projections with per-output-row scales equal to the whole model's:
    a column-parallel shard holds whole rows; a row-parallel shard (o_proj, down) holds part of
    each row, so the rows' absolute maxima are max-reduced over the TP group first and appended as
    one extra column while quantizing (then dropped). The shards are then exactly slices of the
    whole quantization, and TP output equals one process's."""
    for layer in weights.layers:
        if layer.moe is not None:  # whole experts per rank: their own per-channel scales
            layer.moe.quantize_experts(quantize)
        for lin in (layer.qkv, layer.gate_up):
            if lin is None:
                continue
            lin.weight, lin.scale = quantize(lin.weight)
        for lin in (layer.o_proj, layer.down):
            if lin is None:
                continue
            w = lin.weight
            amax = w.abs().amax(dim=1, keepdim=True)
            if state.tp_size > 1:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=state.tp_group)
            q, lin.scale = quantize(torch.cat([w, amax], dim=1))
            lin.weight = q[:, :-1].contiguous()


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Each rank looks up the ids in its vocabulary rows (zeros elsewhere); the sum is the lookup."""
    rows = weight.shape[0]
    local = ids - state.tp_rank * rows
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.masked_fill(outside, 0), weight)
    out.masked_fill_(outside.unsqueeze(-1), 0)
    return all_reduce(out)


def gather_vocab_logits(local: torch.Tensor, vocab_size: int, state: ParallelState) -> torch.Tensor:
    """[S, rows] per rank -> [S, vocab] on every rank (padding rows dropped)."""
    parts = [torch.empty_like(local) for _ in range(state.tp_size)]
    started = time.perf_counter()
    dist.all_gather(parts, local.contiguous(), group=state.tp_group)
    COMM.add("all_gather", local, started)
    return torch.cat(parts, dim=-1)[:, :vocab_size]
