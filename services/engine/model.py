"""The decoder every built-in architecture runs, driven by ModelConfig, over a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvrelay.engine.model_config import ModelConfig, rope_cos_sin_cache
from kvrelay.engine.multimodal.inputs import StepImages
from kvrelay.engine.multimodal.mrope import mixed_cos_sin
from kvrelay.engine.parallel.layers import all_reduce, gather_vocab_logits, vocab_parallel_embedding
from kvrelay.engine.parallel.state import get_parallel_state
from kvrelay.engine.rope import rope_cos_sin_table
from kvrelay.engine.weights import LayerWeights, Linear, ModelWeights
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
    # When every prefill chunk starts at position 0: its longest chunk (the chunks may attend over
    # their own K/V alone, KernelOps.fresh_prefill_attention); else 0.
    prefill_fresh_max_len: int = 0
    # LoRA: (adapter index, its rows of T, None for all) per adapter in the step; None: base model only.
    lora: list[tuple[int, torch.Tensor | None]] | None = None
    # Vision-language models: the rows of T that take image features instead of their placeholder
    # token's embedding (kvrelay.engine.multimodal.inputs.StepImages); None: no image in the step.
    images: StepImages | None = None


class DecoderModel:
    """One decoder for every built-in architecture, its layer recipe read from ModelConfig: the
    Llama layout, plus Gemma's sandwich norms, GeGLU, embedding scale, soft-capping and per-layer
    sliding windows. Branches depend on the config only, never on tensor values (CUDA graphs)."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, ops: KernelOps, max_positions: int,
                 vocab_size: int | None = None):
        """Under tensor parallelism config is the rank's own (its heads and MLP columns, its stage's
        layers) and vocab_size the full vocabulary, which the gathered logits span."""
        self.config = config
        self.parallel = get_parallel_state()
        self.vocab_size = vocab_size or config.vocab_size
        if self.parallel.tp_size > 1:  # row-parallel outputs are partial sums: one all-reduce each
            for lw in weights.layers:
                lw.o_proj.all_reduce = True
                if lw.down is not None:  # None in a sparse (MoE) layer: its experts combine themselves
                    lw.down.all_reduce = True
        self.w = weights
        self.ops = ops
        device = weights.embed.device
        self.cos_sin_cache = rope_cos_sin_cache(config, max_positions).to(device)
        # Gemma 3's sliding layers rotate with their own (default) rope base.
        self.local_cos_sin_cache = self.cos_sin_cache
        if config.local_rope_theta is not None:
            self.local_cos_sin_cache = rope_cos_sin_table(
                "default", {}, config.local_rope_theta, config.head_dim, config.max_position_embeddings,
                max_positions,
            ).to(device)
        self.scale = config.attn_scale if config.attn_scale is not None else config.head_dim**-0.5
        # Attention keyword arguments per layer, only those that are set: kernels without the
        # options keep working for the architectures that do not need them.
        self.attn_kwargs = []
        for window in config.windows:
            kw = {}
            if window is not None:
                kw["window"] = window
            if config.attn_softcap is not None:
                kw["softcap"] = config.attn_softcap
            self.attn_kwargs.append(kw)
        self.embed_scale = None
        if config.embed_scale is not None:  # rounded to the weights' dtype, as transformers does
            self.embed_scale = torch.tensor(config.embed_scale, dtype=weights.embed.dtype, device=device)
        self.act = ops.gelu_tanh_and_mul if config.hidden_act == "gelu_tanh" else ops.silu_and_mul
        # Optional fn(layer_idx, batch), called right after each layer wrote its K/V into the cache
        # (prefill workers stream early layers while later ones compute). None: no cost.
        self.layer_hook = None
        self.adapters = None  # the LoRA adapters served (kvrelay.engine.lora.stacked.LoRASet), if any
        self.lora_plan = None  # the step's StepBatch.lora, while run_layers runs
        self.pooling = False  # a pooling engine's model: compute_logits returns the normed hidden rows
        self.step_rope = None  # (positions, table) replacing the rotary table for one step (M-RoPE)

    def _linear(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        if lin.scale is not None:
            if lin.weight.dtype == torch.float8_e4m3fn:
                out = self.ops.fp8_linear(x, lin.weight, lin.scale, lin.bias)
            else:
                out = self.ops.int8_matmul(x, lin.weight, lin.scale, lin.bias)
        elif lin.packed is not None:
            out = self.ops.packed_linear(x, lin.packed, lin.bias)
        else:
            out = F.linear(x, lin.weight, lin.bias)
        if lin.lora is not None and self.lora_plan:
            out = lin.lora.add(x, out, self.lora_plan)
        return all_reduce(out) if lin.all_reduce else out

    def mlp(self, layer_idx: int, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward block: the gated MLP (MoE models override it, kvrelay.engine.moe_layer)."""
        return self._linear(self.act(self._linear(x, lw.gate_up)), lw.down)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Runs the step, writing new K/V into kv_cache; returns fp32 logits [S, vocab]."""
        self.begin_step(batch.slot_mapping)
        hidden = self.embed(batch.input_ids)
        img = batch.images
        if img is not None:
            hidden.index_copy_(0, img.rows, img.embeds.to(hidden.dtype))
        if img is not None and img.rope_positions is not None:  # image rows rotate by a cos/sin row of their own
            table = self.cos_sin_cache[batch.positions]
            table[img.rows] = mixed_cos_sin(self.cos_sin_cache, img.rope_positions, self.config.mrope_section,
                                            self.config.mrope_interleaved)
            self.step_rope = (torch.arange(table.shape[0], device=table.device), table)
        try:
            hidden, residual = self.run_layers(batch, kv_cache, hidden, None)
        finally:
            self.step_rope = None
        logits = self.compute_logits(batch, hidden, residual)
        self.end_step()
        return logits

    # Per-step state kept on the device (MoE: expert load counters, kvrelay.engine.moe_layer). CUDA
    # graphs capture what these launch, so they must only launch device ops on fixed buffers.
    def begin_step(self, slot_mapping: torch.Tensor) -> None:
        """Before the layers. slot_mapping: the step's rows; padding rows of graphs have slot -1."""

    def mark_rows(self, slot_mapping: torch.Tensor) -> None:
        """Which rows are real tokens, for per-token statistics in the layers (begin_step does it too;
        piecewise graphs call it inside each segment)."""

    def end_step(self) -> None:
        """After the layers."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size > 1:
            hidden = vocab_parallel_embedding(input_ids, self.w.embed, self.parallel)
        else:
            hidden = F.embedding(input_ids, self.w.embed)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        return hidden

    @torch.inference_mode()
    def run_layers(self, batch: StepBatch, kv_cache: torch.Tensor, hidden: torch.Tensor,
                   residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """This model's layers (a pipeline stage's, under pipeline parallelism): (hidden, residual)
        in, (hidden, residual) out; residual None before the first layer. Each layer is three parts,
        so piecewise CUDA graphs (runner/piecewise_graphs.py) can capture the two that do not
        depend on the step's sequences and run attention between them."""
        self.lora_plan = batch.lora
        img = batch.images  # Qwen3-VL: deepstack features join the first layers' outputs
        deep = None if img is None else img.deepstack
        try:
            for layer_idx in range(len(self.w.layers)):
                q, k, v, residual = self.layer_qkv(layer_idx, hidden, residual, batch.positions, batch.slot_mapping,
                                                   kv_cache)
                if self.layer_hook is not None:
                    self.layer_hook(layer_idx, batch)
                attn = self.layer_attention(layer_idx, q, k, v, batch, kv_cache)
                hidden, residual = self.layer_output(layer_idx, attn, residual)
                if deep is not None and layer_idx < deep.shape[0]:  # the stream is hidden + residual
                    hidden.index_add_(0, img.rows, deep[layer_idx].to(hidden.dtype))
        finally:
            self.lora_plan = None
        return hidden, residual

    def layer_qkv(self, layer_idx: int, hidden: torch.Tensor, residual: torch.Tensor | None,
                  positions: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor):
        """Input norm, QKV projection, rotary embedding, and the new K/V written into the cache:
        (q [T, H, D], k, v [T, Hkv, D], residual)."""
        cfg, ops, lw = self.config, self.ops, self.w.layers[layer_idx]
        eps = cfg.rms_norm_eps
        if residual is None:
            x, residual = ops.rms_norm(hidden, lw.input_norm, eps), hidden
        else:
            x, residual = ops.fused_add_rms_norm(hidden, residual, lw.input_norm, eps)
        qkv = self._linear(x, lw.qkv)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.reshape(-1, cfg.num_heads, cfg.head_dim)
        k = k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = ops.rms_norm(q, lw.q_norm, eps)
            k = ops.rms_norm(k, lw.k_norm, eps)
        rope = self.local_cos_sin_cache if "window" in self.attn_kwargs[layer_idx] else self.cos_sin_cache
        if self.step_rope is not None:  # this step's own table, one row per token (M-RoPE)
            positions, rope = self.step_rope
        if ops.rotary_and_write_kv is not None:  # one launch (Triton)
            q, k = ops.rotary_and_write_kv(positions, q, k, v, rope, kv_cache[layer_idx, 0], kv_cache[layer_idx, 1],
                                           slot_mapping)
        else:
            q, k = ops.rotary_embedding(positions, q, k, rope)
            ops.write_kv(k, v, kv_cache[layer_idx, 0], kv_cache[layer_idx, 1], slot_mapping)
        return q, k, v, residual

    def layer_attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        batch: StepBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Attention of the step's rows (decodes, then prefill chunks) over the cache: [T, q_size]."""
        ops, attn_kw, nd = self.ops, self.attn_kwargs[layer_idx], batch.num_decode
        k_cache, v_cache = kv_cache[layer_idx, 0], kv_cache[layer_idx, 1]
        parts = []
        if nd:
            parts.append(
                ops.paged_decode_attention(
                    q[:nd], k_cache, v_cache, batch.decode_block_tables, batch.decode_seq_lens, self.scale, **attn_kw,
                )
            )
        if q.shape[0] > nd:
            out = None
            if batch.prefill_fresh_max_len and ops.fresh_prefill_attention is not None:
                out = ops.fresh_prefill_attention(
                    q[nd:], k[nd:], v[nd:], batch.prefill_query_start_loc, batch.prefill_fresh_max_len,
                    self.scale, **attn_kw,
                )
            if out is None:
                out = ops.paged_prefill_attention(
                    q[nd:], k_cache, v_cache, batch.prefill_block_tables, batch.prefill_query_start_loc,
                    batch.prefill_seq_lens, self.scale, **attn_kw,
                )
            parts.append(out)
        attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        return attn.reshape(-1, self.config.q_size)

    def layer_output(self, layer_idx: int, attn: torch.Tensor, residual: torch.Tensor):
        """Output projection, norms and the feed-forward block: (hidden, residual)."""
        cfg, ops, lw = self.config, self.ops, self.w.layers[layer_idx]
        eps = cfg.rms_norm_eps
        hidden = self._linear(attn, lw.o_proj)
        if cfg.sandwich_norms:
            hidden = ops.rms_norm(hidden, lw.post_norm, eps)
            x, residual = ops.fused_add_rms_norm(hidden, residual, lw.pre_ffn_norm, eps)
            return ops.rms_norm(self.mlp(layer_idx, lw, x), lw.post_ffn_norm, eps), residual
        x, residual = ops.fused_add_rms_norm(hidden, residual, lw.post_norm, eps)
        return self.mlp(layer_idx, lw, x), residual

    @torch.inference_mode()
    def compute_logits(self, batch: StepBatch, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head over the rows that sample: fp32 logits [S, vocab] (a pooling
        model's: the normed hidden rows [S, hidden])."""
        cfg, eps = self.config, self.config.rms_norm_eps
        hidden = hidden.index_select(0, batch.logits_indices)
        residual = residual.index_select(0, batch.logits_indices)
        x, _ = self.ops.fused_add_rms_norm(hidden, residual, self.w.norm, eps)
        if self.pooling:  # embeddings (kvrelay.engine.pooling): the last hidden state, every rank has it whole
            return x.float()
        if self.w.lm_head_packed is not None:
            logits = self.ops.packed_linear(x, self.w.lm_head_packed).float()
        else:
            logits = F.linear(x, self.w.lm_head).float()
        if self.parallel.tp_size > 1:  # each rank scored its vocabulary rows
            logits = gather_vocab_logits(logits, self.vocab_size, self.parallel)
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits
