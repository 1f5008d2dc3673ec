"""One decoder for Llama, Mistral, Qwen2 and Qwen3, driven by ModelConfig, over a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvrelay.engine.model_config import ModelConfig, rope_cos_sin_cache
from kvrelay.engine.weights import Linear, ModelWeights
from kvrelay.kernels.registry import KernelOps


@dataclass
class StepBatch:
    """One forward pass: decode tokens first (one per sequence), then packed prefill chunks."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decode] int32
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [P + 1] int32, relative to the first prefill token
    prefill_seq_lens: torch.Tensor  # [P] int32
    logits_indices: torch.Tensor  # [S] rows of T whose next-token logits are wanted


class DecoderModel:
    def __init__(self, config: ModelConfig, weights: ModelWeights, ops: KernelOps, max_positions: int):
        self.config = config
        self.w = weights
        self.ops = ops
        self.cos_sin_cache = rope_cos_sin_cache(config, max_positions).to(weights.embed.device)
        self.scale = config.head_dim**-0.5
        # Optional fn(layer_idx, batch), called right after each layer wrote its K/V into the cache
        # (prefill workers stream early layers while later ones compute). None: no cost.
        self.layer_hook = None

    def _linear(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        if lin.scale is not None:
            if lin.weight.dtype == torch.float8_e4m3fn:
                return self.ops.fp8_linear(x, lin.weight, lin.scale, lin.bias)
            return self.ops.int8_matmul(x, lin.weight, lin.scale, lin.bias)
        if lin.packed is not None:
            return self.ops.packed_linear(x, lin.packed, lin.bias)
        return F.linear(x, lin.weight, lin.bias)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Runs the step, writing new K/V into kv_cache; returns fp32 logits [S, vocab]."""
        cfg, ops = self.config, self.ops
        nd = batch.num_decode
        hidden = F.embedding(batch.input_ids, self.w.embed)
        residual = None
        for layer_idx, lw in enumerate(self.w.layers):
            if residual is None:
                x, residual = ops.rms_norm(hidden, lw.input_norm, cfg.rms_norm_eps), hidden
            else:
                x, residual = ops.fused_add_rms_norm(hidden, residual, lw.input_norm, cfg.rms_norm_eps)
            qkv = self._linear(x, lw.qkv)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.reshape(-1, cfg.num_heads, cfg.head_dim)
            k = k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = ops.rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
                k = ops.rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
            q, k = ops.rotary_embedding(batch.positions, q, k, self.cos_sin_cache)
            k_cache, v_cache = kv_cache[layer_idx, 0], kv_cache[layer_idx, 1]
            ops.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
            if self.layer_hook is not None:
                self.layer_hook(layer_idx, batch)
            parts = []
            if nd:
                parts.append(
                    ops.paged_decode_attention(
                        q[:nd], k_cache, v_cache, batch.decode_block_tables, batch.decode_seq_lens, self.scale
                    )
                )
            if q.shape[0] > nd:
                parts.append(
                    ops.paged_prefill_attention(
                        q[nd:],
                        k_cache,
                        v_cache,
                        batch.prefill_block_tables,
                        batch.prefill_query_start_loc,
                        batch.prefill_seq_lens,
                        self.scale,
                    )
                )
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
            hidden = self._linear(attn.reshape(-1, cfg.q_size), lw.o_proj)
            x, residual = ops.fused_add_rms_norm(hidden, residual, lw.post_norm, cfg.rms_norm_eps)
            hidden = self._linear(ops.silu_and_mul(self._linear(x, lw.gate_up)), lw.down)
        hidden = hidden.index_select(0, batch.logits_indices)
        residual = residual.index_select(0, batch.logits_indices)
        x, _ = ops.fused_add_rms_norm(hidden, residual, self.w.norm, cfg.rms_norm_eps)
        if self.w.lm_head_packed is not None:
            return self.ops.packed_linear(x, self.w.lm_head_packed).float()
        return F.linear(x, self.w.lm_head).float()
