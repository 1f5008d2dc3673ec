"""The multi-process executor: tensor_parallel_size x pipeline_parallel_size worker processes over
torch.distributed (gloo on CPU, NCCL on CUDA), driven by the engine's one scheduler.

The driver (the engine's process) keeps the scheduler, the block table and the sampler; it builds
each step's inputs once, serializes them once and writes the same bytes to every worker's pipe
(the broadcast), and reads the reply from TP rank 0 of the last stage: the logits, or with a
sampling plan the tokens of the rows that rank sampled and the logits of the others
(remote_sampling.py). To the ModelRunner the executor is the model: `submit(batch, plan)`, then
`collect() -> logits | RemoteLogits`.

A dead worker fails the engine loudly: a step waits on the reply *and* on every worker's process
sentinel, so it raises WorkerDiedError at once instead of hanging; a watchdog thread notices a
death between steps too (LLMEngine.has_work() then reports work, and the next step raises), the
other workers are killed, and serving processes exit non-zero. Workers die with the driver
(PR_SET_PDEATHSIG), and collectives time out rather than hang.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp
from kvrelay.engine.cpu_threads import usable_cpus
from kvrelay.engine.errors import EngineError
from kvrelay.engine.parallel.layers import check_parallel
from kvrelay.engine.parallel.multinode import Leader, NodeLayout, join_timeout, parse_layout, token_from_env
from kvrelay.engine.parallel.rank_metrics import RankStats
from kvrelay.engine.parallel.remote_sampling import RemoteLogits, SamplingPlan
from kvrelay.engine.parallel.worker import (
    WorkerSpec,
    batch_to_wire,
    decode,
    encode,
    tensor_from_wire,
    tensor_to_wire,
    worker_main,
)

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0  # the workers' start-up: model loading and, on CUDA, the memory plan
ERROR_GRACE_S = 1.0  # after a rank's error, how long to look for a peer's death that caused it


class WorkerDiedError(EngineError):
    """A tensor/pipeline-parallel worker process exited or failed; the engine cannot continue."""


@dataclass
class StepStats:
    """Totals over steps as TP rank 0 of the last stage saw them: its step time, and per kind of
    communication (all_reduce, all_gather, send_recv) seconds and bytes."""

    steps: int = 0
    step_s: float = 0.0
    comm_s: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, int] = field(default_factory=dict)
    ranks: RankStats | None = None  # every rank's forward time (rank_metrics.py)

    def as_engine_stats(self) -> dict:
        return {"parallel_steps": self.steps, "parallel_step_seconds": self.step_s,
                "parallel_comm_seconds": dict(self.comm_s), "parallel_comm_bytes": dict(self.comm_bytes),
                **(self.ranks.snapshot() if self.ranks is not None else {})}

    def add(self, step_s: float, comm: dict[str, tuple[float, int]]) -> None:
        self.steps += 1
        self.step_s += step_s
        for kind, (sec, nbytes) in comm.items():
            self.comm_s[kind] = self.comm_s.get(kind, 0.0) + sec
            self.comm_bytes[kind] = self.comm_bytes.get(kind, 0) + nbytes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor:
    layer_hook = None  # no per-layer hooks across processes (the ModelRunner reads this)
    adapters = None  # the LoRA adapters' names (a LoRASet without weights): each worker holds its shards

    def __init__(self, spec_args: dict, tensor_parallel_size: int, pipeline_parallel_size: int,
                 layout: NodeLayout | None = None):
        """spec_args: WorkerSpec's fields except the parallel sizes, rendezvous and threads. layout:
        ranks on several nodes (multinode.py); this process is node 0 and spawns its ranks only."""
        config = spec_args["config"]
        check_parallel(config, tensor_parallel_size, pipeline_parallel_size)
        self.tp, self.pp = tensor_parallel_size, pipeline_parallel_size
        self.world_size = self.tp * self.pp
        self.failed: str | None = None
        self._closing = False
        # The watcher thread and the stepping thread both notice a death; waitpid from both at once
        # leaves the loser without the exit code (ECHILD), so they take turns.
        self._reaping = threading.Lock()
        # One conversation with the workers at a time: steps run on the engine thread, K/V
        # writes of a decode hand-off (gather/scatter) on others.
        self._lock = threading.Lock()
        # The last stage's TP rank 0: step and communication time; and every rank's forward time.
        self.stats = StepStats(ranks=RankStats(self.tp, self.pp))
        # Overlapping pipeline stages (pipeline.py): steps submitted and not yet collected, the most
        # at once, and logits that arrived while another thread waited for a hand-off's reply.
        self.in_flight = 0
        self.max_in_flight = 0
        self._early_replies: list[deque] = [deque() for _ in range(self.world_size)]
        self._plans: deque = deque()  # per submitted step, its SamplingPlan or None
        self.sampled_rows = 0  # rows the last stage sampled itself (remote_sampling.py)
        cores = usable_cpus()  # affinity and cgroup quota
        self.leader: Leader | None = None
        local = self.world_size if layout is None else layout.ranks_per_node  # node 0: ranks [0, local)
        self.spec = WorkerSpec(
            **spec_args, tensor_parallel_size=self.tp, pipeline_parallel_size=self.pp,
            init_method=f"tcp://127.0.0.1:{_free_port()}" if layout is None else layout.init_method,
            threads=max(1, cores // local), timeout_s=float(os.environ.get("KVRELAY_PARALLEL_TIMEOUT_S", "120")),
        )
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []  # procs: this node's ranks; conns: every rank's
        try:
            if layout is not None:
                self.leader = Leader(layout, token_from_env())
            for rank in range(local):
                parent, child = ctx.Pipe()
                main = threading.current_thread() is threading.main_thread()
                proc = ctx.Process(target=worker_main, args=(rank, self.spec, child, main), daemon=True,
                                   name=f"kvrelay-worker-tp{rank % self.tp}-pp{rank // self.tp}")
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
            if self.leader is not None:
                self.leader.accept(self.spec, join_timeout())
                self.conns += [self.leader.rank_conns[r] for r in range(local, self.world_size)]
            ready = [self._recv(r, "ready", LOAD_TIMEOUT_S) for r in range(self.world_size)]
            self.planned_kv_bytes = [planned for planned, _ in ready]
            self.held = [held for _, held in ready]  # per rank: what it loaded (expert_bytes: MoE experts)
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)  # before multiprocessing's own exit handler kills the daemons
        self._watchdog = threading.Thread(target=self._watch, name="kvrelay-worker-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def allocate(self, num_blocks: int) -> None:
        """Every rank allocates its KV cache of num_blocks blocks (its own heads and layers)."""
        self._broadcast(("allocate", num_blocks))
        for r in range(self.world_size):
            self._recv(r, "allocated", LOAD_TIMEOUT_S)

    def forward(self, batch, kv_cache=None) -> torch.Tensor:
        """One step on every worker; the fp32 logits [S, vocab] on the driver's CPU."""
        with self._lock:
            self.check()
            self._broadcast(("step", batch_to_wire(batch)))
            self._plans.append(None)
            return self._step_replies()

    def submit(self, batch, plan: SamplingPlan | None = None) -> None:
        """Send one step to every worker without waiting for its logits (collect() returns them, in
        submission order): the first stage starts the next step while later stages run this one.
        plan: rows the last stage samples itself (remote_sampling.py)."""
        wire = batch_to_wire(batch)
        if plan is not None:
            wire["sampling"] = plan
        with self._lock:
            self.check()
            self._broadcast(("step", wire))
            self._plans.append(plan)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def collect(self) -> torch.Tensor | RemoteLogits:
        """The fp32 logits of the oldest submitted step (RemoteLogits if it had a plan)."""
        with self._lock:
            if self.in_flight == 0:
                raise RuntimeError("collect() without a submitted step")
            logits = self._step_replies()
            self.in_flight -= 1
            return logits

    def _step_replies(self) -> torch.Tensor | RemoteLogits:
        """Every rank's reply to the oldest step (each pipe carries them in step order): the logits
        from TP rank 0 of the last stage, and every rank's forward time."""
        last = self.world_size - self.tp
        forward_s: list[float | None] = [None] * self.world_size
        comms: list[dict] = [{}] * self.world_size
        logits = None
        for rank in (last, *(r for r in range(self.world_size) if r != last)):
            early = self._early_replies[rank]
            out, step_s, comms[rank], forward_s[rank] = early.popleft() if early else self._recv(rank, "logits", None)
            if rank == last:
                logits = out
                self.stats.add(step_s, comms[rank])
        self.stats.ranks.add_step(forward_s, comms)
        plan = self._plans.popleft()
        if plan is not None:
            self.sampled_rows += len(plan.rows)
            return RemoteLogits.from_wire(logits, plan)
        return torch.from_numpy(logits)

    def gather_blocks(self, block_ids: list[int], layer_start: int, layer_end: int) -> torch.Tensor:
        """K/V of block_ids in layers [layer_start, layer_end), every head, as one process's cache
        holds them ([layers, 2, blocks, block_size, kv_heads, head_dim] on the CPU): each rank sends
        its heads of its stage's layers (a prefill worker's side of a hand-off)."""
        cfg = self.spec.config
        out = torch.empty((layer_end - layer_start, 2, len(block_ids), self.spec.block_size, cfg.num_kv_heads,
                           cfg.head_dim), dtype=self.spec.dtype)
        with self._lock:
            self.check()
            self._broadcast(("gather", (list(block_ids), layer_start, layer_end, None)))
            for r in range(self.world_size):
                part = self._recv(r, "gather", LOAD_TIMEOUT_S)
                if part is not None:
                    a, b, (h0, h1), wire = part
                    out[a - layer_start:b - layer_start, :, :, :, h0:h1] = tensor_from_wire(wire)
        return out

    def scatter_blocks(self, block_ids: list[int], kv: torch.Tensor, layer_start: int, layer_end: int) -> None:
        """Write kv (gather_blocks' layout) into block_ids: each rank takes its heads and layers
        (a decode worker's side of a hand-off)."""
        with self._lock:
            self.check()
            self._broadcast(("scatter", (list(block_ids), layer_start, layer_end, tensor_to_wire(kv))))
            for r in range(self.world_size):
                self._recv(r, "scatter", LOAD_TIMEOUT_S)

    def expert_load(self):
        """A MoE model's expert-load counters (moe_layer.ExpertLoad) as TP rank 0 counted them."""
        with self._lock:
            self.check()
            self._broadcast(("expert_load", None))
            loads = [self._recv(r, "expert_load", LOAD_TIMEOUT_S) for r in range(self.world_size)]
        return loads[0]

    def check(self) -> None:
        if self.failed is not None:
            raise WorkerDiedError(self.failed)

    def _broadcast(self, msg) -> None:
        data = encode(msg)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError:
                self._fail(self._death_message(rank))

    def _recv(self, rank: int, kind: str, timeout: float | None):
        """The next message from rank, of this kind; raises WorkerDiedError when any worker dies or
        reports an error first (never waits on a dead process)."""
        conn = self.conns[rank]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([conn, *self._sentinels()], left)
            if conn in ready:
                try:
                    got, _, payload = decode(conn.recv_bytes())
                except (EOFError, OSError):
                    self._fail(self._death_message(rank))
                if got == "error":
                    self._fail(self._error_message(rank, payload))
                if got == "logits" != kind and len(self._early_replies[rank]) < self.in_flight:
                    self._early_replies[rank].append(payload)  # a submitted step's, ahead of a hand-off's reply
                    continue
                if got != kind:
                    self._fail(f"parallel worker rank {rank}: expected {kind!r}, got {got!r}")
                return payload
            if ready:
                self._fail(self._death_message(self._sentinels()[ready[0]]))
            if deadline is not None and time.monotonic() >= deadline:
                self._fail(f"parallel worker rank {rank} sent no {kind!r} within {timeout:.0f}s")

    def _error_message(self, rank: int, traceback: str) -> str:
        """A rank's collective fails when a peer dies (gloo: connection reset): if another rank died,
        it is the cause to name, and this rank's error its consequence."""
        sentinels = self._sentinels()
        own = rank if rank < len(self.procs) else self.leader.layout.node_ranks(
            self.leader.layout.node_of(rank)).start
        ready = wait([s for s, r in sentinels.items() if r != own], ERROR_GRACE_S)
        if ready:
            last = traceback.rstrip().splitlines()[-1]
            return f"{self._death_message(sentinels[ready[0]])}\n(then rank {rank} failed: {last})"
        return f"parallel worker rank {rank} failed:\n{traceback.rstrip()}"

    def _sentinels(self) -> dict:
        """What becomes ready when a rank dies -> that rank (a follower node: its first rank): local
        workers' process sentinels, follower nodes' supervisor connections."""
        out = {p.sentinel: r for r, p in enumerate(self.procs)}
        if self.leader is not None:
            out |= {c: self.leader.layout.node_ranks(n).start for n, c in self.leader.node_conns.items()}
        return out

    def _death_message(self, rank: int) -> str:
        with self._reaping:
            return self._reap(rank) if rank < len(self.procs) else self._reap_remote(rank)

    def _reap_remote(self, rank: int) -> str:
        """A rank on a follower node: its traceback if it sent one, else what its supervisor said."""
        try:
            while self.conns[rank].poll():
                got, _, payload = decode(self.conns[rank].recv_bytes())
                if got == "error":
                    return f"parallel worker rank {rank} failed:\n{payload.rstrip()}"
        except (EOFError, OSError):
            pass
        how, rank = self.leader.node_death(self.leader.layout.node_of(rank))
        return (f"parallel worker rank {rank} (tp rank {rank % self.tp}, pp rank {rank // self.tp}) {how}; "
                f"the engine cannot continue")

    def _reap(self, rank: int) -> str:
        proc = self.procs[rank]
        # Its pipe closes before the kernel has reaped it; a killed process that frees gigabytes on a
        # loaded machine can take seconds, and the exit code is what tells kill -9 from a crash.
        proc.join(timeout=15.0)
        # A worker that failed with an exception sent its traceback before exiting.
        conn = self.conns[rank]
        try:
            while conn.poll():
                got, _, payload = decode(conn.recv_bytes())
                if got == "error":
                    return f"parallel worker rank {rank} (pid {proc.pid}) failed:\n{payload.rstrip()}"
        except (EOFError, OSError):
            pass
        how = ("closed its pipe but is still running" if proc.exitcode is None
               else f"died with exit code {proc.exitcode}")
        return (f"parallel worker rank {rank} (pid {proc.pid}, tp rank {rank % self.tp}, pp rank "
                f"{rank // self.tp}) {how}; the engine cannot continue")

    def _fail(self, message: str):
        if self.failed is None:
            self.failed = message
            log.error("%s", message)
        self._kill_all()
        raise WorkerDiedError(self.failed)

    def _watch(self) -> None:
        sentinels = self._sentinels()
        ready = wait(list(sentinels))
        if self._closing or self.failed is not None:
            return
        message = self._death_message(sentinels[ready[0]])
        if self.failed is None:
            self.failed = message
            log.error("%s", message)
        self._kill_all()

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        if self.leader is not None:  # the follower nodes' supervisors stop their ranks
            self.leader.close()

    def close(self) -> None:
        """Stop every worker (politely first) and wait for them; safe to call twice."""
        if self._closing:
            return
        self._closing = True
        if self.failed is None:
            self._broadcast_quietly(("close", None))
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill_all()
        for p in self.procs:
            p.join(timeout=5.0)
        for c in self.conns:
            c.close()
        if self.leader is not None:
            self.leader.close()

    def _broadcast_quietly(self, msg) -> None:
        data = encode(msg)
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError:
                pass

    def kv_bytes_per_block(self, block_size: int) -> int:
        """The most any rank's KV cache needs per block id (its heads, its stage's layers)."""
        from kvrelay.engine.parallel.layers import local_kv_heads, stage_layers

        cfg = self.spec.config
        layers = max(b - a for a, b in (stage_layers(cfg.num_layers, self.pp, s) for s in range(self.pp)))
        heads = local_kv_heads(cfg.num_kv_heads, self.tp)
        return layers * 2 * block_size * heads * cfg.head_dim * self.spec.dtype.itemsize

    def planned_blocks(self, bytes_per_block: int, cpu_bytes: int) -> int:
        """Blocks without --kv-cache-memory: on CUDA what every rank's memory plan allows, on CPU
        cpu_bytes per rank."""
        if self.spec.device_type != "cuda":
            return cpu_bytes // bytes_per_block
        return min(self.planned_kv_bytes) // bytes_per_block


def start_executor(args, config, dtype: torch.dtype, device: torch.device, kernel_backend: str, max_model_len: int,
                   kv_cache_storage=None, spec=None, pooling: bool = False) -> MultiprocExecutor:
    """The executor for EngineArgs' parallel sizes, after the checks that need no worker. pooling:
    an embedding model's (kvrelay.engine.pooling): the workers return hidden rows for the logits."""
    from kvrelay.engine import architectures
    from kvrelay.engine.lora import lora_names
    from kvrelay.engine.model import DecoderModel

    adapters = lora_names(args)
    build_model = architectures.get(config.architecture).build_model
    if build_model is not None and not (isinstance(build_model, type) and issubclass(build_model, DecoderModel)):
        raise ValueError(f"{config.architecture} runs its own model class: --tensor-parallel-size and "
                         f"--pipeline-parallel-size support the built-in decoder's architectures only")
    if config.moe is not None and args.pipeline_parallel_size > 1:
        raise ValueError(f"{config.architecture} (mixture of experts): --pipeline-parallel-size must be 1; split "
                         f"it with --tensor-parallel-size (and --enable-expert-parallel)")
    if kv_cache_storage is not None:
        raise ValueError("a KV cache in shared host memory (--kv-shared-cache) needs --tensor-parallel-size 1 and "
                         "--pipeline-parallel-size 1")
    if spec is not None and spec.method == "draft":
        raise ValueError("--speculative-method draft needs --tensor-parallel-size 1 and --pipeline-parallel-size 1 "
                         "(use --speculative-method ngram)")
    if args.load_format not in ("auto", "dummy"):
        raise ValueError(f"load format must be 'auto' or 'dummy', got {args.load_format!r}")
    if args.quantization not in (None, "int8", "fp8"):
        raise ValueError(f"quantization must be None, 'int8' or 'fp8', got {args.quantization!r}")
    if (device.type == "cuda" and args.pipeline_parallel_size > 1 and args.kv_cache_memory is None
            and not args.num_kv_blocks):
        raise ValueError("--pipeline-parallel-size on CUDA: give --kv-cache-memory (per GPU) or --num-kv-blocks")
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    layout = None
    if getattr(args, "nnodes", 1) > 1:
        layout = parse_layout(args.nnodes, args.node_rank, args.dist_init_addr, world)
        if layout.node_rank != 0:
            raise ValueError(f"--node-rank {layout.node_rank}: the engine is node 0; on the other nodes run "
                             f"`{layout.follower_command(layout.node_rank)}`")
    local = world if layout is None else layout.ranks_per_node
    if device.type == "cuda" and torch.cuda.device_count() < local:
        raise ValueError(f"{local} parallel ranks on this node need {local} GPUs, but it has "
                         f"{torch.cuda.device_count()}")
    executor = MultiprocExecutor(
        {"model_dir": str(args.model), "config": config, "dtype": dtype, "device_type": device.type,
         "kernel_backend": kernel_backend, "load_format": args.load_format, "dummy_seed": args.dummy_seed,
         "quantization": args.quantization, "max_model_len": max_model_len, "block_size": args.block_size,
         "gpu_memory_utilization": args.gpu_memory_utilization,
         "max_num_batched_tokens": args.max_num_batched_tokens, "plugins": args.plugins,
         "enable_expert_parallel": args.enable_expert_parallel,
         "lora_modules": tuple(args.lora_modules or ()), "max_lora_rank": args.max_lora_rank, "pooling": pooling},
        args.tensor_parallel_size, args.pipeline_parallel_size, layout,
    )
    executor.adapters = adapters
    return executor
