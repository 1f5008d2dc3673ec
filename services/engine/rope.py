"""Rotary position tables: default, linear, llama3, dynamic (NTK), yarn and longrope scaling.

The engine bakes the whole table once, for the longest context it serves (max_model_len), so the
forward pass only indexes it: no per-step recomputation and nothing that depends on a batch.
transformers recomputes "dynamic" and "longrope" frequencies from each forward's longest
sequence instead; the table here is the one transformers uses for a sequence of max_model_len
tokens, which equals transformers' output for every sequence when max_model_len is within the
original context (docs/models.md lists what differs beyond it).
"""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


def _positive(params: dict, key: str) -> bool:
    value = params.get(key)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def check_rope_params(rope_type: str, params: dict) -> str | None:
    """What is wrong with a rope type's parameters, or None."""
    if rope_type in ("linear", "llama3", "dynamic") and not _positive(params, "factor"):
        return f"needs a positive 'factor', got {params.get('factor')!r}"
    if rope_type == "yarn":
        if params.get("factor") is not None and not _positive(params, "factor"):
            return f"needs a positive 'factor', got {params.get('factor')!r}"
        if not _positive(params, "original_max_position_embeddings"):
            return "needs a positive 'original_max_position_embeddings'"
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if not isinstance(params.get(key), list) or not params[key]:
                return f"needs '{key}', a list of one factor per rotary frequency"
        if len(params["short_factor"]) != len(params["long_factor"]):
            return "needs 'short_factor' and 'long_factor' of the same length"
        if not _positive(params, "original_max_position_embeddings"):
            return "needs a positive 'original_max_position_embeddings'"
    return None


def context_limit(rope_type: str, params: dict, max_position_embeddings: int) -> int:
    """The longest context a rope scaling supports: dynamic NTK and yarn stretch the trained one
    by their factor; the others' max_position_embeddings already says how far they reach."""
    if rope_type == "dynamic":
        return int(max_position_embeddings * float(params["factor"]))
    if rope_type == "yarn" and params.get("factor"):
        return max(max_position_embeddings, int(params["original_max_position_embeddings"] * float(params["factor"])))
    return max_position_embeddings


def _yarn(inv_freq_base: torch.Tensor, base: float, dim: int, params: dict, max_pos: int):
    factor = params.get("factor") or max_pos / params["original_max_position_embeddings"]
    factor = float(factor)
    original = float(params["original_max_position_embeddings"])
    attention_factor = params.get("attention_factor")
    if attention_factor is None:

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over the context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the dim keeps its frequency (extrapolates); 0: interpolated by factor
    inv_freq = inv_freq_base / factor * (1 - keep) + inv_freq_base * keep
    return inv_freq, float(attention_factor)


def inv_freq_and_scale(
    rope_type: str, params: dict, theta: float, dim: int, max_pos: int, max_positions: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] and the factor cos and sin are multiplied by, for a table of
    max_positions positions. max_pos: the config's max_position_embeddings."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(params["factor"])
        low = float(params.get("low_freq_factor", 1.0))
        high = float(params.get("high_freq_factor", 4.0))
        old_len = float(params.get("original_max_position_embeddings", max_pos))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "dynamic":
        # NTK: a larger base for contexts past the trained length (transformers' table for max_positions).
        factor = float(params["factor"])
        seq_len = max(max_positions, max_pos)
        base = theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base**exponents), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, theta, dim, params, max_pos)
    if rope_type == "longrope":
        original = int(params["original_max_position_embeddings"])
        factor = params.get("factor") or max_pos / original
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        # Long factors once the served context passes the original one; short factors otherwise.
        ext = params["long_factor"] if max_positions > original else params["short_factor"]
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta**exponents), float(attention_factor)
    return inv_freq, 1.0


def rope_cos_sin_table(
    rope_type: str, params: dict, theta: float, dim: int, max_pos: int, max_positions: int
) -> torch.Tensor:
    """[max_positions, dim] fp32: cos in the first half, sin in the second, scaled by the
    rope type's attention factor (yarn, longrope)."""
    inv_freq, scale = inv_freq_and_scale(rope_type, params, theta, dim, max_pos, max_positions)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(), inv_freq)
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return table * scale if scale != 1.0 else table
