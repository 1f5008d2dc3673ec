"""Plain torch references for every kernel. On CPU the engine runs these (with native C kernels
for some, see kvrelay.kernels.native_ops); on GPU the Triton kernels are tested against them.

Shapes and layout, shared with the Triton kernels (same signatures):
- T tokens in a step, Hq query heads, Hkv KV heads, D head dim, B sequences.
- KV cache of the whole model: kv_cache[L, 2, num_blocks, block_size, Hkv, D]; one layer's
  K cache is kv_cache[l, 0] (contiguous [num_blocks, block_size, Hkv, D]), V is kv_cache[l, 1].
- A token's slot is block_id * block_size + offset_in_block.
- block_tables[B, max_blocks] int32: a sequence's blocks in order (unused entries arbitrary).
- seq_lens[B] int32: tokens of context per sequence, including this step's new tokens.
- fused_moe (mixture-of-experts MLP) lives in kvrelay.kernels.moe_reference, re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvrelay.kernels.moe_reference import fused_moe  # noqa: F401 - the registry's "fused_moe"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32, as HF Llama does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-rotation rotary embedding (HF Llama layout).

    positions[T] int64; q[T, Hq, D], k[T, Hkv, D]; cos_sin_cache[max_pos, D] fp32 holding
    cos in the first D/2 columns and sin in the last D/2 (rope scaling is baked into the cache).
    """
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions)
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1).unsqueeze(1).to(q.dtype)
    sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1).unsqueeze(1).to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x[T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x[T, 2I] = [gate | up] -> gelu_tanh(gate) * up, [T, I] (GeGLU, Gemma's MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value[T, Hkv, D] into one layer's caches at slot_mapping[T] (slot < 0: skip)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slot_mapping] = key.to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slot_mapping] = value.to(v_cache.dtype)


def _gather_context(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` tokens from a paged layer cache: [length, Hkv, D]."""
    # index_select, not cache[blocks]: advanced indexing is ~15x slower on CPU for this gather.
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def _softcap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma's attention-logit soft-capping: cap * tanh(scores / cap), in place."""
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    return scores


def _decode_attention_padded(q, k_cache, v_cache, block_tables, seq_lens, scale, window=None, softcap=None):
    max_len = int(seq_lens.max())
    block_size = k_cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    batch = q.shape[0]
    table = block_tables[:, :num_blocks].long().flatten()
    # Gather each sequence's blocks, padded to the longest: [B, Hkv, ctx, D] views.
    # index_select, not k_cache[table]: advanced indexing is ~15x slower on CPU for this gather.
    k = k_cache.index_select(0, table).view(batch, -1, *k_cache.shape[2:])[:, :max_len].transpose(1, 2)
    v = v_cache.index_select(0, table).view(batch, -1, *v_cache.shape[2:])[:, :max_len].transpose(1, 2)
    key_pos = torch.arange(max_len, device=q.device)[None, :]
    lens = seq_lens[:, None].long()
    valid = key_pos < lens
    if window is not None:  # the last `window` tokens, the new one included
        valid &= key_pos >= lens - window
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q.float()[:, :, None],
            k.float(),
            v.float(),
            attn_mask=valid[:, None, None, :],
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[:, :, 0].to(q.dtype)
    # Soft-capping sits between the product and the softmax, where SDPA has no hook.
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    qg = q.float().view(batch, hkv, group, -1)  # the query heads of a GQA group on their KV head
    scores = _softcap(torch.matmul(qg, k.float().transpose(2, 3)).mul_(scale), softcap)
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())
    return out.reshape(q.shape).to(q.dtype)


# Decode attention runs in length-sorted buckets whose padded K+V copy is at most about this
# big (so it is still in cache when attention reads it back), of at least 8 sequences each.
# On 2 CPU cores, 8 buckets instead of 4 at 64 decodes took benchmarks/throughput.py's kvrelay
# run from 27.7 s to 26.4 s; with a tiny model one bucket saves the per-bucket op overhead.
DECODE_BUCKET_BYTES = 16 * 2**20
MIN_BUCKET_SEQS = 8


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence against its whole paged context. q[B, Hq, D] -> [B, Hq, D].

    window: attend only to the last `window` tokens (sliding-window layers); block-table entries
    for blocks wholly before the window are never read (the scheduler may have freed them).
    softcap: scores -> softcap * tanh(scores / softcap) before the softmax (Gemma 2).

    Sequences are sorted by length and processed in buckets, each padded only to its own longest
    member, so mixed lengths do not gather (and attend over) mostly padding, and each bucket's
    gathered copy is small enough to still be in cache when attention reads it back.
    """
    batch = q.shape[0]
    token_bytes = 2 * k_cache[0, 0].numel() * k_cache.element_size()  # K + V of one token
    copy_bytes = batch * int(seq_lens.max()) * token_bytes
    buckets = min(-(-copy_bytes // DECODE_BUCKET_BYTES), -(-batch // MIN_BUCKET_SEQS))
    if buckets <= 1:
        return _decode_attention_padded(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap)
    order = torch.argsort(seq_lens)
    out = torch.empty_like(q)
    for idx in torch.tensor_split(order, buckets):
        out[idx] = _decode_attention_padded(
            q[idx], k_cache, v_cache, block_tables[idx], seq_lens[idx], scale, window, softcap
        )
    return out


# Query rows per tile of prefill attention: bounds the score buffer ([Hq, tile, context] fp32)
# and lets each tile skip the keys it cannot see.
PREFILL_TILE = 128


def _causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    key_start: int = 0,
) -> torch.Tensor:
    """q[Lq, Hq, D] holds the last Lq positions of a context whose keys/values from position
    key_start on are k, v[ctx - key_start, Hkv, D].

    Tiles of query rows against only the keys the tile can see (up to its last position; with a
    window, from its first row's window start), as two batched matmuls and a softmax: on CPU
    1.5-6x faster than SDPA with a mask (which computes the whole masked square;
    `.venv/bin/python benchmarks/prefill_attention.py`). The query heads of a GQA group are
    stacked on their KV head, so K/V are never repeated.
    """
    lq, hq, d = q.shape
    ctx, hkv, _ = k.shape
    ctx += key_start
    group = hq // hkv
    qh = q.float().view(lq, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, group, Lq, D]
    kh, vh = k.float().permute(1, 0, 2), v.float().permute(1, 0, 2)  # [Hkv, keys, D]
    out = torch.empty(hkv, group, lq, d, device=q.device)
    past = ctx - lq  # query i sits at position past + i
    for start in range(0, lq, PREFILL_TILE):
        end = min(start + PREFILL_TILE, lq)
        rows, keys = end - start, past + end
        first = key_start if window is None else max(key_start, past + start - window + 1)
        scores = torch.bmm(
            qh[:, :, start:end].reshape(hkv, group * rows, d),
            kh[:, first - key_start : keys - key_start].transpose(1, 2),
        )
        scores.mul_(scale)
        _softcap(scores, softcap)
        query_pos = torch.arange(past + start, past + end, device=q.device)[:, None]
        key_pos = torch.arange(first, keys, device=q.device)[None, :]
        hidden = key_pos > query_pos  # the future
        if window is not None:
            hidden |= key_pos <= query_pos - window
        scores.view(hkv, group, rows, keys - first).masked_fill_(hidden, float("-inf"))
        torch.softmax(scores, dim=-1, out=scores)
        out[:, :, start:end] = torch.bmm(scores, vh[:, first - key_start : keys - key_start]).view(
            hkv, group, rows, d
        )
    return out.permute(2, 0, 1, 3).reshape(lq, hq, d).to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """A chunk of new tokens per sequence, causal over its cached prefix plus itself.

    q[T, Hq, D] packs the sequences' new tokens; sequence b owns rows
    query_start_loc[b]:query_start_loc[b+1], which sit at the last positions of its
    seq_lens[b] tokens of context. Their K/V are already written to the cache.
    window / softcap: as in paged_decode_attention (each row sees its last `window` positions).
    """
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, ctx in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end == q_start:
            continue
        # Blocks wholly before the first row's window are not read.
        first_key = 0 if window is None else max(0, ctx - (q_end - q_start) - window + 1)
        first_block = first_key // block_size
        blocks = block_tables[b, first_block : (ctx + block_size - 1) // block_size].long()
        key_start = first_block * block_size
        k = _gather_context(k_cache, blocks, ctx - key_start)
        v = _gather_context(v_cache, blocks, ctx - key_start)
        out[q_start:q_end] = _causal_attention(q[q_start:q_end], k, v, scale, window, softcap, key_start)
    return out


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, layer_start: int, layer_end: int
) -> torch.Tensor:
    """Pack blocks of layers [layer_start, layer_end) into one contiguous buffer.

    Returns [layer_end - layer_start, 2, n, block_size, Hkv, D].
    """
    return kv_cache[layer_start:layer_end].index_select(2, block_ids.long())


def scatter_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor, layer_start: int, layer_end: int
) -> None:
    """Unpack a gather_blocks buffer into block_ids of layers [layer_start, layer_end)."""
    kv_cache[layer_start:layer_end, :, block_ids.long()] = buffer.to(kv_cache.dtype)


def copy_blocks(dst_cache: torch.Tensor, dst_ids: torch.Tensor, src_cache: torch.Tensor, src_ids: torch.Tensor,
                layer_start: int, layer_end: int) -> None:
    """dst block dst_ids[j] <- src block src_ids[j] of layers [layer_start, layer_end), K and V,
    between two caches of the same block shape (the number of blocks may differ)."""
    src = src_cache[layer_start:layer_end].index_select(2, src_ids.long())
    dst_cache[layer_start:layer_end, :, dst_ids.long()] = src.to(dst_cache.dtype)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: weight[N, K] -> (int8[N, K], fp32 scale[N])."""
    w = weight.float()
    amax = w.abs().amax(dim=1).clamp(min=1e-8)
    # Divide by a tensor, not the scalar 127: on CUDA torch turns division by a Python scalar into
    # a multiplication by its reciprocal, which is 1 ulp off the true quotient for some rows (the
    # Triton kernel divides exactly, as the CPU does).
    scale = amax / torch.full_like(amax, 127.0)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def int8_matmul(
    x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x[M, K] @ dequant(weight_int8[N, K], scale[N]).T (+ bias) in x's dtype."""
    out = torch.matmul(x.float(), weight_int8.float().t()) * scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


PACK_PANEL = 16  # output features per panel of a PackedWeight


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight [N, K] laid out for the native packed linear kernel: data[ceil(N / 16), K, 16],
    panel j holding output features 16j .. 16j+15 (zeros past N), so each k's 16 weights are adjacent."""

    data: torch.Tensor
    out_features: int


def pack_linear_weight(weight: torch.Tensor) -> PackedWeight:
    n, k = weight.shape
    panels = -(-n // PACK_PANEL)
    padded = torch.zeros(panels * PACK_PANEL, k, dtype=weight.dtype, device=weight.device)
    padded[:n] = weight
    return PackedWeight(padded.view(panels, PACK_PANEL, k).transpose(1, 2).contiguous(), n)


def unpack_linear_weight(packed: PackedWeight) -> torch.Tensor:
    data = packed.data
    return data.transpose(1, 2).reshape(-1, data.shape[1])[: packed.out_features]


def prepack_linear(weight: torch.Tensor) -> PackedWeight | None:
    """The weight packed for this backend's packed_linear, or None: keep it as it is (torch and
    Triton use it as loaded)."""
    return None


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x[..., K] @ weight.T (+ bias), the weight given packed."""
    return F.linear(x, unpack_linear_weight(packed), bias)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row float8_e4m3fn: x[R, K] -> (fp8[R, K], fp32 scale[R]). Rows are a weight's
    output channels, or an activation's tokens (dynamic per-token scales)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1).clamp(min=1e-12)
    scale = amax / torch.full_like(amax, FP8_MAX)  # a tensor divisor: see quantize_int8
    return (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_linear(
    x: torch.Tensor, weight_fp8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """W8A8: x[M, K] quantized per token to fp8, times weight_fp8[N, K] (per-row scale[N]), fp32
    accumulation, (+ bias) in x's dtype. The products are those of the fp8 GEMM on the GPU."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_fp8(x2)
    out = (xq.float() @ weight_fp8.float().t()) * xs[:, None] * scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight_fp8.shape[0])
