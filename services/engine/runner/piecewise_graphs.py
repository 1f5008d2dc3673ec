"""Piecewise CUDA graphs for steps with prefill (--piecewise-cuda-graphs), per token-count bucket.

A step that prefills runs eagerly: at 1B shapes its ~190 launches from Python cost ~15 ms of host
time on an H200 host, more than the GPU needs for a 2048-token chunk. Attention cannot be
captured (its grid and arguments follow the step's sequences), but everything between two
attentions can: layer i's output projection and MLP, then layer i+1's norm, QKV projection,
rotary embedding and K/V write. So for a bucket of T tokens, L + 1 graphs are captured:

    [embed, qkv(0)]  attention(0)  [output(0), qkv(1)]  attention(1)  ...  [output(L-1)]

and a step replays them with the attentions run eagerly in between. The graphs read and write
fixed buffers (input ids, positions, slots, hidden, residual, q/k/v, the attention output), so
their temporaries die inside each capture and one memory pool serves every segment and bucket.
A step of n tokens is padded to its bucket with rows that write no K/V (slot -1); attention runs
on the real rows only, and the logits are taken eagerly from the real rows.

`use_graphs=False` runs the same segments without capturing them (the CPU tests do, to check the
buffers, padding and attention wiring without a GPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from kvrelay.engine.model import StepBatch
from kvrelay.engine.runner.cuda_graphs import CaptureReport, smallest_bucket

log = logging.getLogger(__name__)


def check_piecewise(device: torch.device, enforce_eager: bool, backend: str, model) -> None:
    """Raises ValueError saying why --piecewise-cuda-graphs cannot run with these settings."""
    from kvrelay.engine.model import DecoderModel

    why = None
    if device.type != "cuda":
        why = "needs --device cuda"
    elif enforce_eager:
        why = "contradicts --enforce-eager"
    elif backend != "triton":
        why = f"needs the triton kernel backend, not {backend!r}"
    elif not isinstance(model, DecoderModel):
        why = "needs the model in this process (no tensor or pipeline parallelism)"
    elif type(model).forward is not DecoderModel.forward:  # the segments would skip what it adds
        why = f"is not for {type(model).__name__} (it overrides the model's forward)"
    if why is not None:
        raise ValueError(f"--piecewise-cuda-graphs {why}")


def token_buckets(max_tokens: int, smallest: int = 256) -> list[int]:
    """Powers of two from `smallest` up to the first that holds max_tokens."""
    sizes = [smallest]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] * 2)
    return sizes


class PiecewiseGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, max_tokens: int):
        cfg = model.config
        self.model = model
        self.kv_cache = kv_cache
        dev, dtype = kv_cache.device, model.w.embed.dtype
        self.num_layers = len(model.w.layers)
        self.ids = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=dev)
        hidden_size = model.w.embed.shape[1]
        self.hidden = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=dev)
        self.residual = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=dev)
        self.q = torch.zeros(max_tokens, cfg.num_heads, cfg.head_dim, dtype=dtype, device=dev)
        self.k = torch.zeros(max_tokens, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        self.attn = torch.zeros(max_tokens, cfg.q_size, dtype=dtype, device=dev)
        # size -> the L + 1 segments, each replayable (a graph's replay, or the segment itself).
        self.segments: dict[int, list[Callable[[], None]]] = {}
        self.sizes: list[int] = []
        self.steps = 0  # steps served (tests and stats read it)

    def _segment(self, size: int, index: int) -> Callable[[], None]:
        """Segment `index` of a size-token step: layer index-1's output part (none for index 0, the
        embedding instead), then layer index's QKV part (none for the last), into the buffers."""
        m, n = self.model, size

        def run() -> None:
            if index == 0:
                hidden, residual = m.embed(self.ids[:n]), None
            else:
                m.mark_rows(self.slots[:n])  # inside the capture: the mask follows each replay's slots
                hidden, residual = m.layer_output(index - 1, self.attn[:n], self.residual[:n])
            if index == self.num_layers:
                self.hidden[:n].copy_(hidden)
                self.residual[:n].copy_(residual)
                return
            q, k, v, residual = m.layer_qkv(index, hidden, residual, self.positions[:n], self.slots[:n], self.kv_cache)
            self.q[:n].copy_(q)
            self.k[:n].copy_(k)
            self.v[:n].copy_(v)
            self.residual[:n].copy_(residual)

        return run

    @torch.inference_mode()
    def capture(self, sizes: list[int], use_graphs: bool = True) -> CaptureReport:
        start = time.perf_counter()
        cuda = use_graphs and self.kv_cache.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
            pool = torch.cuda.graph_pool_handle()
        count = 0
        for size in sorted(sizes, reverse=True):
            segments = []
            for index in range(self.num_layers + 1):
                run = self._segment(size, index)
                if cuda:
                    run()  # compiles this shape's kernels outside the capture
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        run()
                    run = graph.replay
                    count += 1
                segments.append(run)
            self.segments[size] = segments
        self.model.end_step()  # no state of the last segment's run outlives the capture
        self.sizes = sorted(self.segments)
        used = 0
        if cuda:
            torch.cuda.synchronize()
            used = free_before - torch.cuda.mem_get_info()[0]
        report = CaptureReport(count, time.perf_counter() - start, used)
        if cuda:
            log.info("captured %d piecewise CUDA graphs (%d token buckets, %d..%d) in %.1f s, %.0f MiB",
                     count, len(self.sizes), self.sizes[0], self.sizes[-1], report.seconds, used / 2**20)
        return report

    def bucket(self, n: int) -> int | None:
        """The smallest captured size that holds n tokens; None when none does."""
        return smallest_bucket(self.sizes, n)

    @torch.inference_mode()
    def run(self, batch: StepBatch, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's layers through the size-token segments: (hidden, residual) of its real rows.
        batch: the step as built (real rows only; its ids already patched on the device)."""
        m, n = self.model, batch.input_ids.shape[0]
        self.ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slots[:n].copy_(batch.slot_mapping, non_blocking=True)
        if size > n:  # padding rows: token 0 at position 0, writing no K/V
            self.ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(-1)
        segments = self.segments[size]
        m.begin_step(self.slots[:size])
        for layer_idx in range(self.num_layers):
            segments[layer_idx]()
            if m.layer_hook is not None:
                m.layer_hook(layer_idx, batch)
            attn = m.layer_attention(layer_idx, self.q[:n], self.k[:n], self.v[:n], batch, self.kv_cache)
            self.attn[:n].copy_(attn)
        segments[-1]()
        m.end_step()
        self.steps += 1
        return self.hidden[:n], self.residual[:n]

