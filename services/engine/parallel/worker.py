"""One tensor/pipeline-parallel worker process: its rank's part of the model and of the KV cache.

Started by the executor (torch.multiprocessing spawn). It joins the process group, loads its
slices of the checkpoint, and then runs every step the driver broadcasts: the first stage embeds,
each stage runs its layers and sends (hidden, residual) to the same TP rank of the next stage,
and TP rank 0 of the last stage returns the logits. Every rank replies to every step with its own
forward time. It never schedules: the driver decides.

Messages on the pipe are pickled tuples of numpy arrays and ints (never torch tensors, whose
pickling would move the driver's staging buffers into shared memory).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from kvrelay.engine.model_config import ModelConfig
from kvrelay.engine.parallel.remote_sampling import sample_on_worker
from kvrelay.engine.parallel.state import ParallelState, set_parallel_state


@dataclass(frozen=True)
class WorkerSpec:
    model_dir: str
    config: ModelConfig  # the whole model's
    dtype: torch.dtype
    device_type: str  # cpu | cuda
    kernel_backend: str
    load_format: str
    dummy_seed: int
    quantization: str | None
    max_model_len: int
    block_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    init_method: str  # tcp://host:port of the rendezvous
    threads: int  # torch CPU threads per worker
    timeout_s: float  # collectives fail (not hang) after this long
    # CUDA without a fixed KV size: the plan's inputs (each rank plans; the driver takes the minimum)
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    plugins: str | None = None  # the driver's --plugins: architectures from installed packages
    enable_expert_parallel: bool = False  # MoE: the TP ranks hold disjoint experts instead of replicas
    lora_modules: tuple[str, ...] = ()  # --lora-modules: each rank reads them and keeps its shards
    max_lora_rank: int = 16
    pooling: bool = False  # an embedding model (--runner pooling): the last stage returns hidden rows, not logits


def encode(obj) -> bytes:
    return pickle.dumps(obj, protocol=5)


def decode(data: bytes):
    return pickle.loads(data)


def batch_to_wire(batch) -> dict:
    """A StepBatch as numpy arrays and ints (serialized once, sent to every worker)."""
    wire = {k: (v.cpu().numpy() if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()}
    if batch.lora is not None:  # LoRA: (adapter, its rows or None) pairs
        wire["lora"] = [(k, None if rows is None else rows.cpu().numpy()) for k, rows in batch.lora]
    return wire


def batch_from_wire(wire: dict, device: torch.device):
    from kvrelay.engine.model import StepBatch

    batch = StepBatch(**{k: (torch.from_numpy(v).to(device) if isinstance(v, np.ndarray) else v)
                         for k, v in wire.items()})
    if batch.lora is not None:
        batch.lora = [(k, None if rows is None else torch.from_numpy(rows).to(device)) for k, rows in batch.lora]
    return batch


def tensor_to_wire(t: torch.Tensor) -> tuple:
    """Any dtype (bfloat16 too) as raw bytes + shape + dtype."""
    t = t.contiguous().cpu()
    return t.view(-1).view(torch.uint8).numpy(), tuple(t.shape), str(t.dtype).removeprefix("torch.")


def tensor_from_wire(wire: tuple) -> torch.Tensor:
    data, shape, dtype = wire
    return torch.from_numpy(data).view(getattr(torch, dtype)).view(shape)


def _die_with_parent(use_signal: bool) -> None:
    """No orphans: this worker exits when the driver dies, even by SIGKILL. The kernel's parent-death
    signal is immediate, but it fires when the *thread* that started the worker exits, so it is
    used only when that was the driver's main thread; a poll of the parent pid covers the rest."""
    if use_signal and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="kvrelay-parent-watch", daemon=True).start()


def _groups(tp: int, pp: int, rank: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(this rank's TP group, its PP group). Every rank creates every group, in the same order."""
    tp_group = pp_group = None
    for s in range(pp):
        g = dist.new_group(list(range(s * tp, (s + 1) * tp)))
        if tp > 1 and rank // tp == s:
            tp_group = g
    for t in range(tp):
        g = dist.new_group([s * tp + t for s in range(pp)])
        if pp > 1 and rank % tp == t:
            pp_group = g
    return tp_group, pp_group


def _inbox(conn):
    """A recv_bytes that reads from a queue a daemon thread fills from conn (EOF raised in order)."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        while True:
            try:
                inbox.put(conn.recv_bytes())
            except (EOFError, OSError):
                inbox.put(None)  # the driver closed the pipe
                return

    threading.Thread(target=read, name="kvrelay-worker-inbox", daemon=True).start()

    def receive() -> bytes:
        item = inbox.get()
        if item is None:
            raise EOFError
        return item

    return receive


def worker_main(rank: int, spec: WorkerSpec, conn, from_main_thread: bool = True) -> None:
    _die_with_parent(from_main_thread)
    try:
        _serve(rank, spec, conn)
    except (EOFError, BrokenPipeError):  # the driver closed the pipe: it is gone or shutting down
        os._exit(0)
    except BaseException:  # noqa: BLE001 - reported to the driver, then this process exits non-zero
        try:
            conn.send_bytes(encode(("error", rank, traceback.format_exc())))
        except OSError:
            pass
        os._exit(1)


def _serve(rank: int, spec: WorkerSpec, conn) -> None:
    from kvrelay.engine import architectures
    from kvrelay.engine.model import DecoderModel
    from kvrelay.engine.parallel.layers import COMM, kv_head_range, quantize_rank_linears, stage_layers
    from kvrelay.engine.parallel.loader import load_rank_weights
    from kvrelay.engine.parallel.rank_metrics import ForwardTimer
    from kvrelay.engine.runner.memory import plan_kv_cache
    from kvrelay.engine.weights import pack_linears
    from kvrelay.kernels.registry import get_ops

    from kvrelay.plugins import load_plugins

    load_plugins(spec.plugins)  # the same architectures as the driver (spawn starts a fresh interpreter)
    tp, pp = spec.tensor_parallel_size, spec.pipeline_parallel_size
    world = tp * pp
    torch.set_num_threads(spec.threads)
    if spec.device_type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=spec.init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec.timeout_s))
    tp_group, pp_group = _groups(tp, pp, rank)
    state = ParallelState(tp_rank=rank % tp, tp_size=tp, pp_rank=rank // tp, pp_size=pp,
                          tp_group=tp_group, pp_group=pp_group, expert_parallel=spec.enable_expert_parallel)
    set_parallel_state(state)

    ops = get_ops(spec.kernel_backend)
    weights, local = load_rank_weights(spec.model_dir, spec.config, state, spec.dtype, device, spec.load_format,
                                       spec.dummy_seed)
    if spec.quantization == "int8":  # each rank its slices, with the whole rows' scales
        quantize_rank_linears(weights, ops.quantize_int8, state)
    elif spec.quantization == "fp8":
        quantize_rank_linears(weights, ops.quantize_fp8, state)
    pack_linears(weights, ops.prepack_linear)
    build_model = architectures.get(spec.config.architecture).build_model or DecoderModel  # MoE: its subclass
    model = build_model(local, weights, ops, spec.max_model_len, vocab_size=spec.config.vocab_size)
    model.pooling = spec.pooling
    if spec.lora_modules:
        from kvrelay.engine.lora.sharding import load_rank_lora_set

        model.adapters = load_rank_lora_set(spec, state, weights, local)
    planned = None
    if device.type == "cuda":
        planned = plan_kv_cache(model, local, spec.dtype, device, spec.gpu_memory_utilization, spec.block_size,
                                min(spec.max_num_batched_tokens, spec.max_model_len), 1).kv_bytes
    held = {"expert_bytes": model.expert_bytes() if hasattr(model, "expert_bytes") else 0}
    conn.send_bytes(encode(("ready", rank, (planned, held))))
    _, num_blocks = decode(conn.recv_bytes())
    kv_cache = torch.zeros((local.num_layers, 2, num_blocks, spec.block_size, local.num_kv_heads, local.head_dim),
                           dtype=spec.dtype, device=device)
    if hasattr(model, "reset_expert_load"):  # MoE: drop the memory plan's profiling counts
        model.reset_expert_load()
    conn.send_bytes(encode(("allocated", rank, None)))

    prev, nxt = rank - tp, rank + tp
    timer = ForwardTimer(device)
    replies = state.is_last_stage and state.tp_rank == 0
    stage = stage_layers(spec.config.num_layers, pp, state.pp_rank)
    heads = kv_head_range(spec.config.num_kv_heads, tp, state.tp_rank)
    # Of the ranks replicating a KV head, the first one sends it in a hand-off.
    owns_heads = spec.config.num_kv_heads >= tp or state.tp_rank % (tp // spec.config.num_kv_heads) == 0
    # Overlapping stages: the driver sends the next step while the last stage may be writing a large
    # reply; a reader thread keeps taking steps off the pipe, so neither side blocks on a full one.
    receive = _inbox(conn) if pp > 1 else conn.recv_bytes
    while True:
        kind, payload = decode(receive())
        if kind == "close":
            break
        if kind == "expert_load":  # MoE: every rank routes every token, so rank 0's counts are the whole's
            load = model.expert_load() if rank == 0 and hasattr(model, "expert_load") else None
            conn.send_bytes(encode(("expert_load", rank, load)))
            continue
        if kind in ("gather", "scatter"):  # P/D hand-off: this rank's heads of its stage's layers
            block_ids, lo, hi, data = payload
            a, b = max(lo, stage[0]), min(hi, stage[1])
            ids = torch.tensor(block_ids, dtype=torch.long, device=device)
            reply = None
            if a < b and kind == "gather" and owns_heads:
                reply = (a, b, heads, tensor_to_wire(ops.gather_blocks(kv_cache, ids, a - stage[0], b - stage[0])))
            elif a < b and kind == "scatter":
                part = tensor_from_wire(data)[a - lo:b - lo, :, :, :, heads[0]:heads[1]].to(device)
                ops.scatter_blocks(kv_cache, ids, part.contiguous(), a - stage[0], b - stage[0])
            conn.send_bytes(encode((kind, rank, reply)))
            continue
        started = time.perf_counter()
        timer.start()
        logits = None
        plan = payload.pop("sampling", None)  # rows this rank samples (remote_sampling.py)
        batch = batch_from_wire(payload, device)
        with torch.inference_mode():
            model.begin_step(batch.slot_mapping)  # per-step device state, as forward() keeps it (MoE load)
            if state.is_first_stage:
                hidden, residual = model.embed(batch.input_ids), None
            else:
                shape = (batch.input_ids.shape[0], spec.config.hidden_size)
                hidden = torch.empty(shape, dtype=spec.dtype, device=device)
                residual = torch.empty_like(hidden)
                t = time.perf_counter()  # includes waiting for the previous stage's layers
                dist.recv(hidden, src=prev)
                dist.recv(residual, src=prev)
                timer.received(time.perf_counter() - t)  # waiting for the previous stage is not its forward
                COMM.add("send_recv", hidden, t, count=2)
            hidden, residual = model.run_layers(batch, kv_cache, hidden, residual)
            if not state.is_last_stage:
                t = time.perf_counter()
                dist.send(hidden.contiguous(), dst=nxt)
                dist.send(residual.contiguous(), dst=nxt)
                COMM.add("send_recv", hidden, t, count=2)
            else:
                logits = model.compute_logits(batch, hidden, residual)
            model.end_step()
        forward_s = timer.stop()
        # Every rank replies to every step with its forward time (kvrelay:parallel_rank_forward_seconds)
        # and its communication.
        # TP rank 0 of the last stage adds the logits and its step time.
        if replies:
            with torch.inference_mode():
                logits = sample_on_worker(logits, plan)
            reply = (logits, time.perf_counter() - started, COMM.take(), forward_s)
        else:
            reply = (None, None, COMM.take(), forward_s)
        conn.send_bytes(encode(("logits", rank, reply)))
    dist.destroy_process_group()
