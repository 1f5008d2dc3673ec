"""CUDA graphs of the decode forward, one per batch-size bucket.

A decode step launches ~11 kernels per layer; from Python each launch costs more than the kernel
runs at 1B shapes, so the GPU idles most of an eager step. A graph replays the whole forward
(embedding to logits) in one launch. Graphs read fixed addresses, so every bucket's inputs are
views of one set of static buffers, refilled before each replay; a step of n decodes is padded
to the smallest bucket >= n with rows that write no K/V (slot -1) and attend to nothing (length 0).
The largest bucket is captured first so the smaller ones reuse its memory pool.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch
from kvrelay.engine.model import StepBatch

log = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_num_seqs (rounded up to a multiple of 8)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(8, max_num_seqs + 8, 8))
    return sorted({b for b in sizes if b < max_num_seqs + 8})


def smallest_bucket(sizes: list[int], n: int) -> int | None:
    """The smallest of the sorted sizes that is >= n; None when none is."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass
class CaptureReport:
    num_graphs: int
    seconds: float
    memory_bytes: int  # device memory the graphs' pool holds


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, max_batch: int, max_blocks: int):
        self.model = model
        self.kv_cache = kv_cache
        dev = kv_cache.device
        self.ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_batch,), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(max_batch, dtype=torch.int64, device=dev)
        self.empty_i32 = torch.zeros(0, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sizes: list[int] = []

    def _static_batch(self, size: int) -> StepBatch:
        return StepBatch(
            input_ids=self.ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slots[:size],
            num_decode=size,
            decode_block_tables=self.tables[:size],
            decode_seq_lens=self.seq_lens[:size],
            prefill_block_tables=self.empty_i32.view(0, 0),
            prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=self.ids.device),
            prefill_seq_lens=self.empty_i32,
            logits_indices=self.logits_indices[:size],
        )

    def capture(self, sizes: list[int]) -> CaptureReport:
        start = time.perf_counter()
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(sizes, reverse=True):
            batch = self._static_batch(size)
            self.model.forward(batch, self.kv_cache)  # compiles this shape's kernels outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.forward(batch, self.kv_cache)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        self.sizes = sorted(self.graphs)
        report = CaptureReport(len(sizes), time.perf_counter() - start, free_before - torch.cuda.mem_get_info()[0])
        log.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s, %.0f MiB", report.num_graphs,
                 self.sizes[0], self.sizes[-1], report.seconds, report.memory_bytes / 2**20)
        return report

    def bucket(self, n: int) -> int | None:
        """The smallest captured size that holds n decode rows; None when none does."""
        return smallest_bucket(self.sizes, n)

    def replay(self, batch: StepBatch, size: int) -> torch.Tensor:
        """batch: a decode-only step already padded to size rows; returns logits [size, vocab]."""
        width = batch.decode_block_tables.shape[1]
        self.ids[:size].copy_(batch.input_ids, non_blocking=True)
        self.positions[:size].copy_(batch.positions, non_blocking=True)
        self.slots[:size].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:size].copy_(batch.decode_seq_lens, non_blocking=True)
        if width:  # columns past width keep stale ids: never read, the lengths bound every row
            self.tables[:size, :width].copy_(batch.decode_block_tables, non_blocking=True)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits
