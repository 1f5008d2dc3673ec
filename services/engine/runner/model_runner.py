"""Runs a scheduled step on the model: builds its inputs (persistent batch), replays a CUDA graph
for decode-only steps where one is captured, and returns the logits of the rows that sample."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from kvrelay.engine.model import StepBatch
from kvrelay.engine.runner.cuda_graphs import CaptureReport, DecodeGraphs, bucket_sizes
from kvrelay.engine.runner.input_batch import InputBatch
from kvrelay.engine.runner.piecewise_graphs import PiecewiseGraphs, token_buckets
from kvrelay.engine.sequence import Sequence

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.max_num_seqs = max_num_seqs
        # Graph steps are padded up to a bucket, which may exceed the token budget.
        max_tokens = max(max_num_batched_tokens, bucket_sizes(max_num_seqs)[-1])
        self.inputs = InputBatch(block_size, max_model_len, max_num_seqs, max_tokens, self.device)
        self.graphs: DecodeGraphs | None = None
        self.graph_steps = 0  # steps served by a graph replay (tests and stats read it)
        self.piecewise: PiecewiseGraphs | None = None  # --piecewise-cuda-graphs: steps with prefill
        self.prompt_logits: list[tuple[int, int, torch.Tensor]] = []  # see execute()
        self.parallel = hasattr(model, "submit")  # the model is the parallel executor
        # Plain steps' rows are sampled on the worker that has the logits (parallel/remote_sampling.py),
        # and execute() may return its RemoteLogits; benchmarks turn it off for their baseline.
        self.sample_on_worker = self.parallel
        self.has_lora = getattr(model, "adapters", None) is not None  # serves LoRA adapters (kvrelay.engine.lora)
        self.vision = None  # a vision-language model's VisionEncoder (kvrelay.engine.multimodal)

    def capture_graphs(self, sizes: list[int] | None = None) -> CaptureReport:
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need --device cuda")
        sizes = sizes or bucket_sizes(self.max_num_seqs)
        self.graphs = DecodeGraphs(self.model, self.kv_cache, max(sizes), self.inputs.max_blocks)
        return self.graphs.capture(sizes)

    def capture_piecewise_graphs(self, max_tokens: int) -> CaptureReport:
        if self.device.type != "cuda":
            raise ValueError("piecewise CUDA graphs need --device cuda")
        sizes = token_buckets(max_tokens)
        self.piecewise = PiecewiseGraphs(self.model, self.kv_cache, sizes[-1])
        return self.piecewise.capture(sizes)

    def _forward(self, batch: StepBatch, meanwhile=None, plan=None) -> torch.Tensor:
        """An eager step: the model's forward, or the piecewise graphs where a bucket holds its tokens.
        meanwhile: see execute(); plan: the rows the parallel worker samples (remote_sampling.py)."""
        if self.parallel:
            self.model.submit(batch, plan)  # the workers compute while the host runs meanwhile
            try:
                if meanwhile is not None:
                    meanwhile()
            finally:  # the reply is read even if meanwhile fails: the pipes stay in step
                logits = self.model.collect()
            return logits
        # Graphs hold no adapter deltas or image features: a step with either runs eagerly.
        size = None if self.piecewise is None or batch.lora or batch.images is not None \
            else self.piecewise.bucket(batch.input_ids.shape[0])
        if size is None:
            logits = self.model.forward(batch, self.kv_cache)
        else:
            hidden, residual = self.piecewise.run(batch, size)
            logits = self.model.compute_logits(batch, hidden, residual)
        if meanwhile is not None:
            meanwhile()
        return logits

    def _images(self, seqs: list[Sequence], num_new: list[int]) -> tuple[list[int], list[int]]:
        """Indices of seqs whose step reaches image placeholders, and of seqs with M-RoPE positions
        (Qwen2-VL: every step of theirs). The images' features are made here, at the first step that
        reaches them, in one batch for the step's new images (the vision tower runs once per prompt;
        the n samples of a request share their images). Only chunks that reach placeholders ask for
        features, so the images encoded in one step are bounded by the step's token budget."""
        pending, rope, new = [], [], {}
        for i, s in enumerate(seqs):
            images = s.images
            if images is None:
                continue
            if images.rope is not None:
                rope.append(i)
            if images.reaches(s.num_computed, num_new[i]):
                if images.embeds is None:
                    new[id(images)] = images
                pending.append(i)
        if new:
            fresh = list(new.values())
            for im, part in zip(fresh, self.vision.encode_many(fresh)):
                im.embeds, im.pixel_values = part, None
        return pending, rope

    def _graph_size(self, num_new: list[int]) -> int | None:
        if self.graphs is None or self.model.layer_hook is not None:  # the hook runs Python per layer
            return None
        if any(n != 1 for n in num_new):
            return None
        return self.graphs.bucket(len(num_new))

    def execute(self, seqs: list[Sequence], num_new: list[int], all_logits: frozenset[int] = frozenset(),
                prompt_rows: frozenset[int] = frozenset(), token_src: dict[int, int] | None = None,
                prev_tokens: torch.Tensor | None = None,
                meanwhile: Callable[[], None] | None = None) -> tuple[torch.Tensor | None, list[int], list[int]]:
        """Runs the step (K/V of every scheduled token written into the cache). Returns fp32 logits,
        the positions in seqs of the sequences that sample, and how many rows of logits each has
        (one; every new token's for those in all_logits). (None, [], []) when none samples.
        prompt_rows: indices of seqs that want prompt logprobs: their chunks' logits are left in
        self.prompt_logits as (index in seqs, first position, fp32 logits [rows, vocab]).
        token_src, prev_tokens: decodes whose input token is the previous step's sample, still on
        the device (async scheduling): index in seqs -> index in prev_tokens.
        meanwhile: host work to run once while the forward runs, called exactly once: with the
        parallel executor between sending the step and reading its logits (the workers compute), in
        one process after the forward's call returns (on CUDA its launch; on CPU its compute)."""
        adapters = [s.lora for s in seqs] if self.has_lora else None
        if adapters is not None and all(k < 0 for k in adapters):
            adapters = None
        images, rope = self._images(seqs, num_new) if self.vision is not None else (None, None)
        size = None if all_logits or prompt_rows or adapters or images else self._graph_size(num_new)
        extra = {"prompt_rows": prompt_rows} if prompt_rows else {}  # the common call keeps build's old signature
        if images:
            extra["images"] = images
        if rope:
            extra["rope"] = rope
        if token_src:
            extra["token_src"] = token_src
        if adapters:
            extra["adapters"] = adapters
        built = self.inputs.build(seqs, num_new, pad_decode_to=size, all_logits=all_logits, **extra)
        if built.token_src is not None:  # on the device, so nothing waits for the previous step
            ids = built.batch.input_ids[: built.token_src.shape[0]]
            ids.copy_(torch.where(built.token_src >= 0, prev_tokens[built.token_src.clamp(min=0)], ids))
        self.prompt_logits = []
        if built.prompt_spans:
            logits = self._forward(built.batch, meanwhile)
            start = sum(built.logits_rows)
            for i, pos, n in built.prompt_spans:
                self.prompt_logits.append((i, pos, logits[start : start + n]))
                start += n
            if not built.sample_idx:
                return None, [], []
            return logits[: sum(built.logits_rows)], built.sample_idx, built.logits_rows
        if not built.sample_idx and size is None:
            self._forward(built.batch, meanwhile)
            return None, [], []
        if size is not None and len(built.sample_idx) == built.num_real:
            logits = self.graphs.replay(built.batch, size)
            self.graph_steps += 1
            if meanwhile is not None:
                meanwhile()
        elif self.sample_on_worker and built.sample_idx and not all_logits:
            from kvrelay.engine.parallel.remote_sampling import plan

            # The previous step's samples, where they are on the host: the PENDING tokens penalties count.
            on_host = prev_tokens is not None and prev_tokens.device.type == "cpu"
            logits = self._forward(built.batch, meanwhile, plan(seqs, built.sample_idx, token_src if on_host else None,
                                                                prev_tokens if on_host else None))
            if not isinstance(logits, torch.Tensor):  # RemoteLogits: exactly the sampling rows
                return logits, built.sample_idx, built.logits_rows
        else:
            logits = self._forward(built.batch, meanwhile)
        if not built.sample_idx:
            return None, [], []
        # Padding rows come last: the real rows' logits lead. The sampler edits rows of sequences
        # with penalties or biases in place: those get a copy, not a graph's static output.
        logits = logits[: sum(built.logits_rows)]
        if size is not None and any(seqs[i].adjusts_logits for i in built.sample_idx):
            logits = logits.clone()
        return logits, built.sample_idx, built.logits_rows
