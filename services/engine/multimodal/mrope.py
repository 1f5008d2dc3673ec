"""Qwen2-VL's multimodal rotary positions (M-RoPE).

Each token has three positions, (time, height, width), and the rotary frequencies are split in
`mrope_section` groups that rotate by one of them each. Text tokens have three equal positions, so
they rotate exactly as plain rotary at that position; only image features differ. After an image,
text continues from the image's largest position + 1 (not from its token count), so a sequence's
positions run behind its token indices by a fixed delta once its last image is past.

So the engine keeps its plain path: the step's position of each row of such a sequence is rewritten
to its rotary position (rotary_positions), and only the image rows of a prefill chunk, whose axes
differ, get a cos/sin row of their own (StepImages.rope_positions, mixed_cos_sin), in steps that run
eagerly anyway.
"""

from __future__ import annotations

import numpy as np
import torch


def mrope_positions(ids: np.ndarray, image_token_id: int, grids: list[tuple[int, int, int]],
                    merge: int) -> tuple[np.ndarray, int]:
    """([3, len(ids)] positions, delta of the positions after the prompt) as transformers'
    get_rope_index gives them for a prompt whose i-th run of image tokens holds the i-th grid's features."""
    n = len(ids)
    out = np.empty((3, n), dtype=np.int64)
    image = ids == image_token_id
    pos, i, g = 0, 0, 0
    while i < n:
        if image[i]:
            t, h, w = grids[g][0], grids[g][1] // merge, grids[g][2] // merge
            g += 1
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
            count = t * h * w
            out[:, i : i + count] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + pos
            pos += max(h, w)
            i += count
        else:
            j = i + int(np.argmax(image[i:])) if image[i:].any() else n
            out[:, i:j] = np.arange(pos, pos + j - i)
            pos += j - i
            i = j
    return out, int(out.max()) + 1 - n if n else 0


def rotary_positions(positions: np.ndarray, spans) -> None:
    """Rewrite the step's positions of M-RoPE sequences to their rotary positions, in place (an image
    row gets its time position; its cos/sin row is mixed apart). spans: (SequenceImages, first
    position, tokens, first row) per such sequence in the step."""
    for images, start, count, first_row in spans:
        rope = images.rope
        ps = np.arange(start, start + count)
        rows = np.arange(first_row, first_row + count)
        inside = ps < rope.shape[1]
        positions[rows[inside]] = rope[0, ps[inside]]
        positions[rows[~inside]] = ps[~inside] + images.rope_delta


def mixed_cos_sin(cache: torch.Tensor, pos3: torch.Tensor, section: tuple[int, ...],
                  interleaved: bool = False) -> torch.Tensor:
    """Rows of the rotary table [rows, head_dim] (cos half, sin half) where each frequency takes its
    cos and sin at one position axis: the t, h, w sections of mrope_section in turn (Qwen2-VL), or
    interleaved t, h, w, t, h, w, ... while h and w last (Qwen3-VL)."""
    half = cache.shape[1] // 2
    if interleaved:
        axis = torch.zeros(half, dtype=torch.long)
        axis[1 : 3 * section[1] : 3] = 1
        axis[2 : 3 * section[2] : 3] = 2
        axis = axis.to(cache.device)
    else:
        axis = torch.repeat_interleave(torch.arange(len(section)) % 3, torch.tensor(section)).to(cache.device)
    axis = torch.cat([axis, axis])  # the sin half as the cos half
    cols = torch.arange(2 * half, device=cache.device)
    return cache[pos3[axis].T, cols]
