"""The synchronous engine core: requests in, one scheduled forward pass per step, outputs out.

Not thread-safe: AsyncEngine drives it from a single thread.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from kvrelay.engine.async_scheduling import PENDING, AsyncScheduling
from kvrelay.engine.block_pool import BlockPool
from kvrelay.engine.cpu_threads import plan_threads
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.errors import InvalidRequestError, ModelLoadError
from kvrelay.engine.handoff import HandoffMixin
from kvrelay.engine.lora.stacked import request_counts
from kvrelay.engine.malloc_tuning import keep_large_buffers_mapped
from kvrelay.engine.model_config import load_model_config, parse_dtype
from kvrelay.engine.model_loader import load_model
from kvrelay.engine.multimodal import load_vision
from kvrelay.engine.outputs import EngineStats, RequestOutput
from kvrelay.engine.pooling.config import setup_pooling
from kvrelay.engine.pooling.pooler import accumulate, finish_pooled, wants_prompt_rows
from kvrelay.engine.prompt_logprobs import record_prompt_logprobs
from kvrelay.engine.request_builder import RequestBuilderMixin
from kvrelay.engine.runner.memory import choose_num_blocks
from kvrelay.engine.runner.model_runner import ModelRunner
from kvrelay.engine.runner.piecewise_graphs import check_piecewise
from kvrelay.engine.sampler import sample
from kvrelay.engine.sampling_params import SamplingParams, defaults_from_generation_config
from kvrelay.engine.scheduler import Scheduler, SchedulerConfig
from kvrelay.engine.sequence import Sequence, Status
from kvrelay.engine.spec_decode.draft import DraftModel, kv_bytes_per_block, load_draft_config
from kvrelay.engine.spec_decode.speculator import SpecConfig, Speculator, check_config
from kvrelay.engine.spec_decode.verify import verify
from kvrelay.engine.structured.compiler import compiler_for
from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.kernels.registry import cpu_backend, get_ops

from kvrelay.plugins import load_plugins

log = logging.getLogger(__name__)


def _read_generation_config(model_dir: Path) -> dict:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e


def _as_id_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, list) else [value])}


def _window_of_every_layer(windows: tuple[int | None, ...]) -> int | None:
    """The widest window when every layer has one (blocks past it can be freed), else None."""
    return None if not windows or None in windows else max(windows)


class LLMEngine(RequestBuilderMixin, HandoffMixin):
    def __init__(self, args: EngineArgs, kv_cache_storage: Callable[[int], torch.Tensor] | None = None):
        """kv_cache_storage(nbytes): zeroed host memory for the KV cache as a uint8 tensor, where
        it must live somewhere shared (a prefill worker's kvtransfer.shm.SharedKVCache); CPU only."""
        self.args = args
        self.kv_cache_storage = kv_cache_storage
        load_plugins(args.plugins)  # architectures and logits processors from installed packages
        spec = None
        if args.speculative_method is not None:
            spec = SpecConfig(args.speculative_method, args.num_speculative_tokens, args.ngram_min, args.ngram_max,
                              args.speculative_disable_batch_size, args.speculative_model,
                              args.speculative_adaptive)
            check_config(spec)
        model_dir = Path(args.model)
        if not model_dir.is_dir():
            raise ModelLoadError(f"{model_dir}: model folder not found")
        self.config = load_model_config(model_dir)
        # An embedding or classification model's pooler (kvrelay.engine.pooling); None: it generates.
        self.pooler, self.config = setup_pooling(args, model_dir, self.config)
        self.model_name = args.served_model_name or model_dir.name
        self.tokenizer = Tokenizer(model_dir)
        self.generation_config = _read_generation_config(model_dir)
        dtype_name = args.dtype if args.dtype != "auto" else (self.config.torch_dtype or "float32")
        self.dtype = parse_dtype(dtype_name)
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        if self.device.type == "cpu":
            keep_large_buffers_mapped()  # each step's activations are multi-MiB buffers
            threads = plan_threads(args.cpu_threads, args.reserved_cpus)
            if threads.threads is not None:
                torch.set_num_threads(threads.threads)
            log.info("%s", threads.describe())
        backend = args.kernel_backend
        if backend == "auto" and self.device.type != "cuda":
            backend = cpu_backend()  # Triton kernels need CUDA tensors (the interpreter is for tests)
        self.ops = get_ops(backend)
        world = args.tensor_parallel_size * args.pipeline_parallel_size
        self.vision = load_vision(args, model_dir, self.config, self.dtype, self.device,  # images: LLaVA
                                  parallel=world > 1 or args.distributed_executor_backend == "mp",
                                  speculative=spec is not None and spec.method != "ngram", pooling=self.pooler is not None)

        # Sliding-window layers attend to their window in the kernels: the context is not capped at it.
        self.max_model_len = self.config.max_context
        if args.max_model_len is not None:
            if args.max_model_len > self.max_model_len:
                raise ValueError(
                    f"--max-model-len {args.max_model_len} exceeds what the model supports ({self.max_model_len})"
                )
            self.max_model_len = args.max_model_len

        # --tensor/pipeline-parallel-size: worker processes hold the model and the KV cache; this
        # process keeps the scheduler and the sampler (kvrelay.engine.parallel.executor).
        self.executor = None
        if args.distributed_executor_backend not in (None, "mp", "uni"):
            raise ValueError(f"--distributed-executor-backend must be mp or uni, got "
                             f"{args.distributed_executor_backend!r}")
        if args.distributed_executor_backend == "uni" and world > 1:
            raise ValueError(f"--distributed-executor-backend uni runs one process: it cannot hold "
                             f"--tensor-parallel-size x --pipeline-parallel-size = {world} ranks; use mp")
        if world > 1 or args.distributed_executor_backend == "mp":
            from kvrelay.engine.parallel.executor import start_executor

            self.executor = start_executor(args, self.config, self.dtype, self.device, self.ops.backend,
                                           self.max_model_len, kv_cache_storage, spec, pooling=self.pooler is not None)
            self.model, self.device = self.executor, torch.device("cpu")  # logits come back to the CPU
        else:
            self.model = load_model(args, model_dir, self.config, self.dtype, self.device, self.ops,
                                    self.max_model_len)
            self.model.pooling = self.pooler is not None and self.pooler.task == "embed"

        cfg = self.config
        bs = args.block_size
        bytes_per_block = kv_bytes_per_block(cfg, self.dtype, bs)
        if self.executor is not None:  # per rank: its heads and its stage's layers
            bytes_per_block = self.executor.kv_bytes_per_block(bs)
        sizing_bytes = bytes_per_block  # per block id: the target's K/V, and the draft's
        draft = None
        if spec is not None and spec.method == "draft":  # its KV cache shares the target's block ids
            if _window_of_every_layer(cfg.windows) is not None:
                raise ValueError("--speculative-method draft: the target frees blocks behind its sliding window, "
                                 "which the draft still reads; use --speculative-method ngram")
            draft = DraftModel(spec.model, load_draft_config(spec.model, cfg, self.tokenizer), self.dtype,
                               self.device, self.ops, self.max_model_len)
            sizing_bytes += kv_bytes_per_block(draft.config, self.dtype, bs)
        use_graphs = self.device.type == "cuda" and not args.enforce_eager and self.ops.backend == "triton"
        use_graphs &= self.pooler is None  # a pooling engine has no decode steps to replay
        if args.piecewise_cuda_graphs:
            check_piecewise(self.device, args.enforce_eager, self.ops.backend, self.model)
        num_blocks = choose_num_blocks(args, self.model, self.executor, cfg, self.dtype, self.device, sizing_bytes,
                                       self.max_model_len, use_graphs)
        shape = (cfg.num_layers, 2, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
        if self.executor is not None:  # each rank holds its part; the driver only the block table
            self.executor.allocate(num_blocks)
            self.kv_cache = torch.zeros((*shape[:2], 0, *shape[3:]), dtype=self.dtype)
        elif kv_cache_storage is not None:  # zeroed and committed by the storage already
            if self.device.type != "cpu":
                raise ValueError("a KV cache in shared host memory needs --device cpu")
            self.kv_cache = kv_cache_storage(num_blocks * bytes_per_block).view(self.dtype).view(shape)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self.device.type == "cpu":
                # torch.zeros of this size maps pages lazily; touch them all now, so the memory is
                # committed at start (not when a pod is already serving) and writing a block never
                # page-faults mid-step or mid-hand-off (~0.5 ms per 4 MiB of fresh blocks here).
                self.kv_cache.view(-1).fill_(0)
        self.runner = ModelRunner(self.model, self.kv_cache, bs, self.max_model_len, args.max_num_seqs,
                                  args.max_num_batched_tokens)
        self.runner.sample_on_worker &= self.pooler is None  # a pooling step's rows are vectors: nothing to sample
        self.runner.vision = self.vision
        if use_graphs:
            self.runner.capture_graphs()
        if args.piecewise_cuda_graphs:
            self.runner.capture_piecewise_graphs(min(args.max_num_batched_tokens, self.max_model_len))
        if hasattr(self.model, "reset_expert_load"):  # MoE: drop the planner's and graph warm-ups' counts
            self.model.reset_expert_load()
        self.pool = BlockPool(num_blocks, args.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.scheduling_policy, bs,
                            sliding_window=_window_of_every_layer(cfg.windows)),
            self.pool,
        )
        self.speculator = None
        if spec is not None:
            if draft is not None:
                draft.allocate(num_blocks, bs, args.max_num_seqs, args.max_num_batched_tokens, use_graphs)
            self.speculator = Speculator(spec, self.scheduler, args.max_num_batched_tokens, draft)
        self.pipeline = None  # several steps in flight so pipeline stages overlap
        overlap = args.pipeline_overlap
        if self.executor is not None and overlap is None:
            overlap = self.executor.spec.device_type == "cuda"  # each stage on its own GPU
        # Overlapping stages keep decodes flowing; a pooling engine has none, and pools in _run.
        if self.executor is not None and args.pipeline_parallel_size > 1 and overlap and spec is None and not self.pooler:
            from kvrelay.engine.parallel.pipeline import PipelineOverlap

            self.pipeline = PipelineOverlap(self, args.pipeline_parallel_size)
        self.overlap = None  # --async-scheduling: step N+1 launched before step N's tokens are read
        if args.async_scheduling:
            if args.pipeline_parallel_size > 1:
                raise ValueError("--async-scheduling does not combine with --pipeline-parallel-size > 1: its "
                                 "overlapping stages keep several steps in flight already")
            self.overlap = AsyncScheduling(self)
            log.info("async scheduling: each step is launched before the previous step's tokens are read")
        self.eos_ids = _as_id_set(self.generation_config.get("eos_token_id"))
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        # Structured output: compiled grammars, shared with the gateway's validation in `serve`.
        self.grammars = compiler_for(self.tokenizer, tuple(self.eos_ids))
        self.requests: dict[str, list[Sequence]] = {}
        # Held while K/V is written into a reservation from outside the engine thread
        # (write_reserved), and while abort() frees a reservation: never freed under a writer.
        self._reserved_lock = threading.Lock()
        self._next_seq_id = 0
        # CUDA: a step's detokenizing and stop strings run during the next step's forward, whose
        # launch returns at once; a token that ends its sequence by id or length is final at once.
        # With the parallel executor on CUDA, while its worker processes compute the next step. On
        # CPU the workers take every core: no gain measured (benchmarks/parallel.py), and each
        # token's output would come one step later, so it stays opt-in there.
        default = self.device.type == "cuda" or (self.executor is not None and self.executor.spec.device_type == "cuda")
        self.defer_outputs = args.async_output if args.async_output is not None else default
        self._deferred: list[tuple[Sequence, int, object]] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        log.info(
            "engine ready: %s (%s, %s) on %s, kernels %s, KV cache %d blocks of %d tokens (%.0f MiB), "
            "max_model_len %d", self.model_name, cfg.architecture, dtype_name, self.device, self.ops.backend,
            num_blocks, bs, num_blocks * bytes_per_block / 2**20, self.max_model_len,
        )

    @property
    def runner_type(self) -> str:
        return "generate" if self.pooler is None else "pooling"

    # ---- requests -----------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        return defaults_from_generation_config(self.generation_config)

    def add(self, seqs: list[Sequence]) -> None:
        self.requests[seqs[0].request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
        self.prompt_tokens_total += seqs[0].prompt_len

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        hold_blocks: bool = False,
        cache_salt: str | None = None,
    ) -> list[Sequence]:
        self._check_new_id(request_id)
        seqs = self.make_request(prompt, params, request_id, priority, hold_blocks, cache_salt)
        self.add(seqs)
        return seqs

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Finish every unfinished sample of the request and free its blocks now."""
        outputs = []
        seqs = self.requests.pop(request_id, [])
        pending = set()  # sequences with a token appended in the last step, its output deferred
        if self._deferred:
            pending = {d[0] for d in self._deferred if d[0].request_id == request_id}
            self._deferred = [d for d in self._deferred if d[0] not in pending]
        for seq in seqs:
            seq.hold_blocks = False
            if seq.finished:
                self.scheduler.free_blocks(seq)  # blocks held for a hand-off
                continue
            if seq.status is Status.RESERVED:
                with self._reserved_lock:  # a write_reserved in progress finishes first
                    self.scheduler.finish(seq, "abort")
            else:
                self.scheduler.finish(seq, "abort")
            seq.metrics.finished_time = time.monotonic()
            if seq in pending:  # never reported: dropped, as the synchronous engine drops a token
                seq.token_ids.pop()  # computed after the client's last output
            while seq.token_ids[-1] == PENDING:  # async scheduling: sampled, not read back yet
                seq.token_ids.pop()
            outputs.append(self._output(seq, [], seq.detok.take(final=True)))
        return outputs

    def close(self) -> None:
        """Stop the parallel worker processes (nothing to do in one process)."""
        if self.executor is not None:
            self.executor.close()

    def has_work(self) -> bool:
        # A dead parallel worker is work: the next step raises, so the engine fails at once.
        failed = self.executor is not None and self.executor.failed is not None
        in_flight = self.pipeline is not None and bool(self.pipeline.in_flight)
        in_flight |= self.overlap is not None and self.overlap.in_flight is not None
        return self.scheduler.has_work() or bool(self._deferred) or failed or in_flight

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_free=self.pool.num_free,
            prefix_cache_queries=self.pool.queries,
            prefix_cache_hits=self.pool.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            # MoE counters (with worker processes, read from TP rank 0 on demand)
            expert_load=getattr(self.model, "expert_load", None) if self.config.moe is not None else None,
            **request_counts(getattr(self.model, "adapters", None), self.scheduler),
            **(self.speculator.engine_stats() if self.speculator is not None else {}),
            **(self.executor.stats.as_engine_stats() if self.executor is not None else {}),
        )

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.executor is not None:
            self.executor.check()
        if self.pipeline is not None:  # --pipeline-parallel-size > 1: overlapping stages
            return self.pipeline.step()
        if self.overlap is not None:
            return self.overlap.step()
        step = self.scheduler.schedule()
        if not step.seqs:
            return self._flush_deferred()
        now = time.monotonic()
        for seq in step.seqs:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        if self.speculator is None:
            return self._run(step, {})
        return self._speculative_step(step)

    def _speculative_step(self, step) -> list[RequestOutput]:
        tokens_before = self.generation_tokens_total
        outputs = self._run(step, self.speculator.propose(step))
        self.speculator.finish_step(self.generation_tokens_total - tokens_before)
        return outputs

    def _run(self, step, proposals: dict) -> list[RequestOutput]:
        pool_rows = self.pooler is not None and wants_prompt_rows(self.pooler)  # MEAN, CLS: every prompt row
        scoring = frozenset(i for i, s in enumerate(step.seqs) if (s.prompt_lps is not None or pool_rows)
                            and s.num_computed < s.prompt_len - 1)
        flushed = None
        meanwhile = None
        if self.executor is not None and not proposals:  # the workers compute while the driver makes text
            flushed = []
            meanwhile = lambda: flushed.extend(self._flush_deferred())
        logits, sample_idx, rows = self.runner.execute(step.seqs, step.num_new, frozenset(proposals), scoring,
                                                       meanwhile=meanwhile)
        if pool_rows and scoring:
            accumulate(self.pooler, step.seqs, self.runner.prompt_logits)
        elif scoring:
            record_prompt_logprobs(step.seqs, self.runner.prompt_logits)
        return self._after_forward(step, proposals, logits, sample_idx, rows, flushed)

    def _after_forward(self, step, proposals: dict, logits, sample_idx, rows,
                       flushed: list[RequestOutput] | None = None) -> list[RequestOutput]:
        """flushed: the last step's deferred outputs, if made during the forward already."""
        if proposals:
            self.speculator.withdraw(step, proposals)
        # On CUDA the forward is still running: turn the last step's tokens into text meanwhile.
        outputs = self._flush_deferred() if flushed is None else flushed
        bs = self.args.block_size
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_new)):
            if seq.finished or i in proposals:  # ended at a stop string found just now; verified below
                continue
            seq.num_computed += n
            if seq.num_computed // bs > seq.num_registered:  # a block filled up: make it findable
                self.scheduler.register_full_blocks(seq)
        if not sample_idx:
            return outputs
        if self.pooler is not None:  # the rows are the prompts' last hidden states
            return outputs + finish_pooled(self, [step.seqs[i] for i in sample_idx], logits)
        if proposals:
            logits = self._verify(step.seqs, proposals, logits, sample_idx, rows, outputs)
            sample_idx = [i for i in sample_idx if i not in proposals]
        to_sample = [step.seqs[i] for i in sample_idx]
        if not to_sample:
            return outputs
        tokens, logprobs = sample(logits, to_sample)
        now = time.monotonic()
        for seq, token, lp in zip(to_sample, tokens, logprobs):
            if not seq.finished:  # else this step computed a token past a stop string: dropped
                self._emit(seq, token, lp, now, outputs)
        return outputs

    def _verify(self, seqs, proposals, logits, sample_idx, rows, outputs) -> torch.Tensor:
        """Verify each speculating sequence against its rows of logits and emit what it accepted;
        returns the rows of the other sampling sequences, for the plain sampler."""
        plain, start = [], 0
        for i, count in zip(sample_idx, rows):
            if i not in proposals:
                plain.append(start)
            else:
                seq = seqs[i]
                proposal, computed_before = proposals[i]
                if not seq.finished:
                    emitted, lps = verify(seq, logits[start : start + count], proposal)
                    self.speculator.record(seq, proposal, emitted, computed_before)
                    now = time.monotonic()
                    for token, lp in zip(emitted, lps):
                        if seq.finished:
                            break  # a stop id or max_tokens inside the accepted run: the rest is dropped
                        self._emit(seq, token, lp, now, outputs)
                    if not seq.finished:  # K/V is valid for the last token and the accepted proposals
                        seq.num_computed = computed_before + len(emitted)
                        self.scheduler.register_full_blocks(seq)
            start += count
        if plain == list(range(len(plain))):  # the plain rows lead: a view, no copy
            return logits[: len(plain)]
        return logits.index_select(0, torch.tensor(plain, dtype=torch.int64, device=logits.device))

    def _emit(self, seq: Sequence, token: int, lp, now: float, outputs: list[RequestOutput]) -> None:
        if self.defer_outputs and not self._finishes(seq, token):
            seq.token_ids.append(token)
            self.generation_tokens_total += 1
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            self._deferred.append((seq, token, lp))
        else:
            outputs.append(self._append_token(seq, token, lp, now))

    def _finishes(self, seq: Sequence, token: int) -> bool:
        """Whether token ends seq by a stop id or its length (stop strings need the text)."""
        generated = len(seq.token_ids) + 1 - seq.prompt_len
        return generated >= seq.max_tokens or token in seq.stop_ids and generated >= seq.params.min_tokens

    def _flush_deferred(self) -> list[RequestOutput]:
        """Text, stop strings and outputs of tokens appended in the last step (defer_outputs)."""
        if not self._deferred:
            return []
        deferred, self._deferred = self._deferred, []
        outputs = []
        for seq, token, lp in deferred:
            if seq.finished:  # aborted since
                continue
            stop_string = seq.detok.add_token(token)
            if stop_string is not None:
                self._finish(seq, "stop", stop_string, time.monotonic())
            outputs.append(self._output(seq, [token], seq.detok.take(final=seq.finished), [lp] if lp else None))
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob, now: float) -> RequestOutput:
        seq.token_ids.append(token)
        return self._settle_token(seq, token, logprob, now)

    def _settle_token(self, seq: Sequence, token: int, logprob, now: float) -> RequestOutput:
        """Stop checks and the output of token, the last of seq.token_ids."""
        self.generation_tokens_total += 1
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        reason, stop_reason = self._stop_check(seq, token)
        if reason is not None:
            self._finish(seq, reason, stop_reason, now)
        return self._output(
            seq, [token], seq.detok.take(final=reason is not None), [logprob] if logprob else None
        )

    @staticmethod
    def _stop_check(seq: Sequence, token: int) -> tuple[str | None, object]:
        """(finish reason, stop reason) once token, the last of seq.token_ids, is detokenized."""
        generated = len(seq.token_ids) - seq.prompt_len
        if token in seq.stop_ids and generated >= seq.params.min_tokens:
            if seq.params.include_stop_str_in_output:  # the stop token's text too (none if it is special)
                seq.detok.add_token(token)
            return "stop", (token if token in seq.params.stop_token_ids else None)
        stop_string = seq.detok.add_token(token)
        if stop_string is not None:
            return "stop", stop_string
        if generated >= seq.max_tokens:
            return "length", None
        return None, None

    def _finish(self, seq: Sequence, reason: str, stop_reason, now: float) -> None:
        self.scheduler.finish(seq, reason, stop_reason)
        seq.metrics.finished_time = now
        if all(s.finished for s in self.requests.get(seq.request_id, [])) and not seq.hold_blocks:
            self.requests.pop(seq.request_id, None)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", field="request_id")

    def _output(self, seq: Sequence, new_ids: list[int], text: str, logprobs=None) -> RequestOutput:
        prompt_lps = None
        if seq.prompt_lps is not None and (new_ids or seq.finished):
            prompt_lps, seq.prompt_lps = [None, *seq.prompt_lps], None
        return RequestOutput(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=new_ids,
            text=text,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.prompt_len,
            num_generated_tokens=len(seq.token_ids) - seq.prompt_len,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=seq.metrics,
            prompt_logprobs=prompt_lps,
            embedding=seq.embedding,
        )
