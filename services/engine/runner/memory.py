"""Sizing the KV cache on a GPU from --gpu-memory-utilization, as vLLM users expect.

The KV cache gets what is left of `utilization x total device memory` after what is already in use
(weights, the CUDA context, other processes), the peak activations of the largest prefill step
(measured by running one), and the decode graphs' pool (measured as the peak of the largest
decode bucket run eagerly, which is what its graph's pool holds); with piecewise graphs, one more
prefill step's activations and their fixed buffers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from kvrelay.engine.model import StepBatch
from kvrelay.engine.runner.piecewise_graphs import token_buckets

log = logging.getLogger(__name__)

GIB = 2**30


@dataclass
class MemoryPlan:
    total: int
    utilization: float
    in_use: int  # before the KV cache: weights, CUDA context, other processes
    prefill_peak: int  # activations of one max_num_batched_tokens step
    graph_reserve: int  # activations of the largest decode bucket
    kv_bytes: int

    def describe(self) -> str:
        return (
            f"GPU memory plan: {self.utilization:.2f} x {self.total / GIB:.1f} GiB = "
            f"{self.utilization * self.total / GIB:.2f} GiB; in use {self.in_use / GIB:.2f} GiB (weights, "
            f"context), prefill activations {self.prefill_peak / GIB:.2f} GiB, decode graphs "
            f"{self.graph_reserve / GIB:.2f} GiB -> KV cache {self.kv_bytes / GIB:.2f} GiB"
        )


def _peak_bytes(model, batch: StepBatch, cache: torch.Tensor) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model.forward(batch, cache)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _profile_cache(cfg, blocks: int, block_size: int, dtype, device) -> torch.Tensor:
    return torch.zeros((cfg.num_layers, 2, blocks, block_size, cfg.num_kv_heads, cfg.head_dim), dtype=dtype,
                       device=device)


def plan_kv_cache(model, cfg, dtype: torch.dtype, device: torch.device, utilization: float, block_size: int,
                  prefill_tokens: int, decode_batch: int, piecewise: bool = False) -> MemoryPlan:
    """piecewise: piecewise graphs will be captured, whose pool keeps one prefill step's activations
    for good (the eager steps still need their own), plus their fixed buffers (see piecewise_graphs)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    i64 = {"dtype": torch.int64, "device": device}
    i32 = {"dtype": torch.int32, "device": device}
    blocks = -(-prefill_tokens // block_size)
    cache = _profile_cache(cfg, blocks, block_size, dtype, device)
    prefill = StepBatch(
        input_ids=torch.zeros(prefill_tokens, **i64),
        positions=torch.arange(prefill_tokens, **i64),
        slot_mapping=torch.arange(prefill_tokens, **i64),
        num_decode=0,
        decode_block_tables=torch.zeros((0, 0), **i32),
        decode_seq_lens=torch.zeros(0, **i32),
        prefill_block_tables=torch.arange(blocks, **i32)[None],
        prefill_query_start_loc=torch.tensor([0, prefill_tokens], **i32),
        prefill_seq_lens=torch.tensor([prefill_tokens], **i32),
        logits_indices=torch.tensor([prefill_tokens - 1], **i64),
    )
    prefill_peak = _peak_bytes(model, prefill, cache)
    decode = StepBatch(
        input_ids=torch.zeros(decode_batch, **i64),
        positions=torch.zeros(decode_batch, **i64),
        slot_mapping=torch.full((decode_batch,), -1, **i64),
        num_decode=decode_batch,
        decode_block_tables=torch.zeros((decode_batch, 1), **i32),
        decode_seq_lens=torch.ones(decode_batch, **i32),
        prefill_block_tables=torch.zeros((0, 0), **i32),
        prefill_query_start_loc=torch.zeros(1, **i32),
        prefill_seq_lens=torch.zeros(0, **i32),
        logits_indices=torch.arange(decode_batch, **i64),
    )
    graph_reserve = _peak_bytes(model, decode, cache)
    if piecewise:
        row = 2 * model.w.embed.shape[1] + 2 * cfg.q_size + 2 * cfg.kv_size  # hidden, residual, q, attention, k, v
        buckets = token_buckets(prefill_tokens)
        graph_reserve += prefill_peak + buckets[-1] * (row * dtype.itemsize + 24)  # + ids, positions, slots
    del cache, prefill, decode
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    kv_bytes = int(utilization * total) - in_use - prefill_peak - graph_reserve
    plan = MemoryPlan(total, utilization, in_use, prefill_peak, graph_reserve, kv_bytes)
    if kv_bytes <= 0:
        raise ValueError(f"no memory left for the KV cache: {plan.describe()}; raise --gpu-memory-utilization, "
                         "lower --max-num-batched-tokens or --max-num-seqs, or free the device")
    return plan


def choose_num_blocks(args, model, executor, cfg, dtype: torch.dtype, device: torch.device, sizing_bytes: int,
                      max_model_len: int, use_graphs: bool) -> int:
    """The KV cache's blocks: --num-kv-blocks, else --kv-cache-memory, else what every parallel
    rank's plan allows, else on CUDA what the memory plan leaves, else the CPU default. sizing_bytes:
    per block id (the target's K/V, and a draft model's). Fails when one sequence would not fit."""
    from kvrelay.engine.engine_args import cpu_kv_cache_blocks
    from kvrelay.engine.runner.cuda_graphs import bucket_sizes

    bs = args.block_size
    if args.num_kv_blocks:
        num_blocks = args.num_kv_blocks
    elif args.kv_cache_memory is not None:
        num_blocks = args.kv_cache_memory // sizing_bytes
    elif executor is not None:
        cpu_blocks = cpu_kv_cache_blocks(sizing_bytes, bs, args.max_num_seqs, max_model_len)
        num_blocks = executor.planned_blocks(sizing_bytes, cpu_blocks * sizing_bytes)
    elif device.type == "cuda":
        plan = plan_kv_cache(
            model, cfg, dtype, device, args.gpu_memory_utilization, bs,
            min(args.max_num_batched_tokens, max_model_len),
            bucket_sizes(args.max_num_seqs)[-1] if use_graphs else 1, args.piecewise_cuda_graphs,
        )
        log.info("%s", plan.describe())
        num_blocks = plan.kv_bytes // sizing_bytes
    else:
        num_blocks = cpu_kv_cache_blocks(sizing_bytes, bs, args.max_num_seqs, max_model_len)
    if num_blocks * bs < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {bs} tokens ({num_blocks * bs} tokens), less than one "
            f"sequence of max_model_len {max_model_len}: raise --kv-cache-memory or lower --max-model-len"
        )
    return num_blocks
