"""What prefill and decode workers share: options, the gRPC server, the load stream, /metrics,
and the command-line runner used by `kvrelay prefill` and `kvrelay decode`."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
from dataclasses import dataclass

import grpc
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_args import EngineArgs, parse_bytes
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.engine.malloc_tuning import keep_large_buffers_mapped
from kvrelay.engine.stats_logger import StatsLogger
from kvrelay.kvtransfer.grpc_options import server_options
from kvrelay.kvtransfer.health_http import serve_health
from kvrelay.kvtransfer.layout import DEFAULT_MAX_MESSAGE_BYTES, KVLayout, plan_chunks
from kvrelay.kvtransfer.load import LoadServicer
from kvrelay.kvtransfer.metrics import WorkerMetrics
from kvrelay.kvtransfer.shm import SharedKVCache
from kvrelay.kvtransfer.watchdog import HANG_AFTER_STEPS_ENV, Watchdog, WatchdogConfig, install_hang_hook
from kvrelay.v1 import load_pb2_grpc

from kvrelay import interrupt
from kvrelay.log_format import add_log_arguments

log = logging.getLogger(__name__)


NODE_NAME_ENV = "KVRELAY_NODE_NAME"
SHUTDOWN_TIMEOUT_S = 25.0  # --shutdown-timeout, every role: under Kubernetes' default 30 s grace


@dataclass
class WorkerOptions:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # bound on every gRPC message, KV chunks included
    model_revision: str | None = None  # None: fingerprint of config + weights
    metrics_port: int | None = None  # serve /metrics here (prometheus_client); None: off
    load_interval_s: float = 0.5  # default period of the load stream
    node_name: str = ""  # the node this worker runs on, published on the load stream ("": unknown)
    # prefill side
    lease_seconds: float = 30.0  # held blocks without progress or ack are freed after this
    layer_group_size: int = 0  # layers per streamed group; 0: a quarter of the layers
    stream_min_tokens: int = 256  # prompts at least this long stream layer groups while computing
    debug_chunk_delay_s: float = 0.0  # fault injection for tests: pause after each chunk sent
    # decode side
    allow_local_prefill: bool = True  # when every prefill worker failed, prefill on the decode worker
    # Give up one remote prefill after this long (then the next prefill worker or a local prefill);
    # the request's own deadline bounds it too.
    handoff_timeout_s: float = 15.0
    # Shared-memory data plane for prefill workers on the same node (kvrelay.kvtransfer.shm):
    # arena bytes (0: off, K/V always inline on gRPC) and the memory-backed directory holding it.
    kv_shm_bytes: int = 0
    kv_shm_dir: str = "/dev/shm"
    # With the arena (or the CUDA IPC plane), a Unix socket beside it on which same-node hand-offs
    # signal between the engine threads (kvrelay.kvtransfer.doorbell); False: on the gRPC stream.
    kv_doorbell: bool = True
    # decode side: send PrefillStart while the engine thread reserves the blocks, which waits for the
    # step in flight (the prefix-cache hits are probed first); False: reserve, then start.
    kv_early_start: bool = True
    # prefill side: the KV cache in a shared-memory file in kv_shm_dir, so a decode worker on this
    # node copies held blocks straight out of it (the direct hand-off; needs its doorbell).
    kv_shared_cache: bool = False
    # decode side: a K/V transport from a kvrelay.kv_transports plugin by name (None: gRPC, built in).
    kv_transport: str | None = None
    # The step-loop watchdog (kvrelay.kvtransfer.watchdog): hung after this long, exit after the grace.
    watchdog_timeout_s: float = 30.0
    watchdog_grace_s: float = 10.0
    stats_interval_s: float = 10.0  # the periodic engine stats line (kvrelay.engine.stats_logger); 0: off
    # Mooncake data plane (--kv-transport mooncake, kvrelay.kvtransfer.mooncake): the address this
    # worker's transfer engine listens on, which its peers reach (the pod IP); the decode side's
    # protocol ("tcp" or "rdma") and the bytes of its registered region arena (in kv_shm_dir).
    kv_mooncake_host: str = ""  # "": this host's address as its hostname resolves
    kv_mooncake_protocol: str = "tcp"
    kv_remote_bytes: int = 256 * 2**20


def add_worker_args(parser: argparse.ArgumentParser, role: str) -> None:
    EngineArgs.add_cli_args(parser)
    d = WorkerOptions()
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, required=True, help="gRPC port (0: any free port, printed at start)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus /metrics, and /health and /ready for probes, on this port")
    parser.add_argument("--stats-interval", dest="stats_interval_s", type=float, default=d.stats_interval_s,
                        help="seconds between engine stats lines in the log (idle intervals are skipped; 0: off)")
    add_log_arguments(parser)
    parser.add_argument("--watchdog-timeout", dest="watchdog_timeout_s", type=float, default=d.watchdog_timeout_s,
                        help="the engine's step loop counts as hung after this many seconds without progress "
                             "(or 100 mean step times, if longer): the worker turns unhealthy on its load stream, "
                             "/health and /ready")
    parser.add_argument("--watchdog-grace", dest="watchdog_grace_s", type=float, default=d.watchdog_grace_s,
                        help="seconds a hung worker stays up (unhealthy) before it exits with code 1 to be restarted")
    parser.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S,
                        help="on SIGTERM, seconds the worker drains: it reports draining (gateways send it "
                             "nothing new) while its streams in flight finish, then aborts the rest; keep it under "
                             "the pod's terminationGracePeriodSeconds (30 by default)")
    parser.add_argument("--max-message-bytes", type=parse_bytes, default=d.max_message_bytes,
                        help="largest gRPC message, KV chunks included (default 4MiB)")
    parser.add_argument("--model-revision", default=None,
                        help="revision checked in every KV hand-off (default: fingerprint of config and weights)")
    parser.add_argument("--node-name", default=os.environ.get(NODE_NAME_ENV, d.node_name),
                        help=f"the node this worker runs on, published to the gateway, which pairs prefill "
                             f"and decode workers on one node for the shared-memory data plane (default: "
                             f"${NODE_NAME_ENV}, set by the operator from the pod's spec.nodeName)")
    parser.add_argument("--kv-mooncake-host", default=d.kv_mooncake_host,
                        help="address this worker's Mooncake transfer engine listens on and peers reach it at "
                             "(the pod IP; default: what this host's name resolves to; for --kv-transport mooncake)")
    if role == "prefill":
        parser.add_argument("--kv-lease-seconds", dest="lease_seconds", type=float, default=d.lease_seconds,
                            help="free held KV blocks if the decode worker neither reads nor acknowledges "
                                 "for this long")
        parser.add_argument("--layer-group-size", type=int, default=d.layer_group_size,
                            help="layers per streamed group (0: a quarter of the model's layers)")
        parser.add_argument("--stream-min-tokens", type=int, default=d.stream_min_tokens,
                            help="stream layer groups while computing for prompts at least this long")
        parser.add_argument("--debug-chunk-delay", dest="debug_chunk_delay_s", type=float, default=0.0,
                            help=argparse.SUPPRESS)  # fault injection for tests
        parser.add_argument("--kv-shared-cache", action="store_true",
                            help="keep the KV cache in a shared-memory file in --kv-shm-dir, so that decode "
                                 "workers on this node with a doorbell copy held blocks straight out of it (one "
                                 "copy instead of two; CPU only; the file is as big as the KV cache)")
        parser.add_argument("--kv-shm-dir", default=d.kv_shm_dir,
                            help="memory-backed directory the decode workers also mount, for --kv-shared-cache")
    else:
        parser.add_argument("--no-local-prefill", dest="allow_local_prefill", action="store_false",
                            help="fail requests whose prefill workers all failed instead of prefilling here")
        parser.add_argument("--handoff-timeout", dest="handoff_timeout_s", type=float, default=d.handoff_timeout_s,
                            help="seconds before one remote prefill is abandoned")
        parser.add_argument("--kv-shm-bytes", type=parse_bytes, default=d.kv_shm_bytes,
                            help="offer prefill workers on this node a shared-memory arena of this size for "
                                 "K/V (e.g. 256MiB; 0: off, K/V travels inline on gRPC)")
        parser.add_argument("--kv-shm-dir", default=d.kv_shm_dir,
                            help="memory-backed directory both workers mount, holding the arena file (and "
                                 "the doorbell socket of --kv-transport cuda-ipc)")
        parser.add_argument("--no-kv-doorbell", dest="kv_doorbell", action="store_false",
                            help="with --kv-shm-bytes or --kv-transport cuda-ipc: no doorbell socket; chunk "
                                 "headers and acks of same-node hand-offs go on the gRPC stream")
        parser.add_argument("--no-kv-early-start", dest="kv_early_start", action="store_false",
                            help="reserve a request's blocks before asking the prefill worker to start (by "
                                 "default the prefill starts while the reservation waits for the step in flight)")
        parser.add_argument("--kv-transport", default=None,
                            help="mooncake (a transfer-engine region prefill workers on any node write into), "
                                 "cuda-ipc (same-node GPU caches, device to device), or a transport from a "
                                 "kvrelay.kv_transports plugin (default: K/V inline on gRPC)")
        parser.add_argument("--kv-mooncake-protocol", choices=("tcp", "rdma"), default=d.kv_mooncake_protocol,
                            help="with --kv-transport mooncake: RDMA where the nodes have it, else TCP")
        parser.add_argument("--kv-remote-bytes", type=parse_bytes, default=d.kv_remote_bytes,
                            help="with --kv-transport mooncake: bytes of the registered region arena (in "
                                 "--kv-shm-dir) prefill workers write into (default 256MiB)")


def make_engine(args: EngineArgs, options: WorkerOptions) -> AsyncEngine:
    """A worker's engine; with kv_shared_cache (prefill workers) its KV cache is a SharedKVCache."""
    storage = SharedKVCache(options.kv_shm_dir) if options.kv_shared_cache else None
    return AsyncEngine(engine=LLMEngine(args, kv_cache_storage=storage))


def options_from_cli(args: argparse.Namespace) -> WorkerOptions:
    return WorkerOptions(**{k: getattr(args, k) for k in WorkerOptions.__dataclass_fields__ if hasattr(args, k)})


class WorkerBase:
    role = "worker"

    def __init__(self, engine: AsyncEngine, options: WorkerOptions | None = None):
        self.engine = engine
        self.options = options or WorkerOptions()
        self.layout = KVLayout.of_engine(engine.engine, self.options.model_revision)
        plan_chunks(self.layout, 0, 1, 1, self.options.max_message_bytes)  # ValueError: one block must fit
        self.metrics = WorkerMetrics(engine)
        self.stats_logger = StatsLogger(engine.stats, self.options.stats_interval_s, f"{self.role} engine")
        self.watchdog = Watchdog(engine, WatchdogConfig(self.options.watchdog_timeout_s,
                                                        grace_s=self.options.watchdog_grace_s), self.role)
        self.load = LoadServicer(self.role, engine, self.layout, self.active_handoffs, self.options.load_interval_s,
                                 node=self.options.node_name, healthy=lambda: self.watchdog.reason or None)
        self.server: grpc.aio.Server | None = None
        self._metrics_server = None
        self.port: int | None = None

    def active_handoffs(self) -> int:
        return 0

    def add_services(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        await self.engine.start()
        self.watchdog.start()
        self.stats_logger.start()
        # Room for a full chunk plus gRPC framing.
        self.server = grpc.aio.server(options=server_options(self.options.max_message_bytes + 65536))
        self.add_services(self.server)
        load_pb2_grpc.add_LoadServiceServicer_to_server(self.load, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"cannot listen on {host}:{port}")
        await self.server.start()
        if self.options.metrics_port is not None:
            self._metrics_server = serve_health(self.options.metrics_port, host, self.metrics.registry,
                                                alive=lambda: self.watchdog.reason or None,
                                                ready=self._not_ready)
        return self.port

    def _not_ready(self) -> str | None:
        if self.watchdog.reason:
            return self.watchdog.reason
        return "draining" if self.load.draining else None

    async def stop(self, grace_s: float = 1.0) -> None:
        self.load.draining = True
        if self.server is not None:
            await self.server.stop(grace_s)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        await self.watchdog.stop()
        await self.stats_logger.stop()
        await self.engine.shutdown()


PARENT_PID_ENV = "KVRELAY_PARENT_PID"  # set by `kvrelay serve --disaggregated` for its local workers


def _stop_with_parent() -> None:
    """SIGTERM this worker when the process that started it exits, however it exits (Linux)."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        return  # not Linux
    if os.getppid() != int(parent):  # the parent was already gone before the line above
        raise SystemExit("kvrelay worker: the process that started it has exited")


async def serve_forever(worker_cls, args: argparse.Namespace) -> int:
    _stop_with_parent()
    keep_large_buffers_mapped()
    options = options_from_cli(args)
    try:
        engine = make_engine(EngineArgs.from_cli(args), options)
        if engine.pooler is not None:
            raise ValueError("this is an embedding model (--runner pooling): an embedding has no decode phase to hand "
                             "over; serve it with `kvrelay serve`")
        worker = worker_cls(engine, options)
        hang = os.environ.get(HANG_AFTER_STEPS_ENV)
        install_hang_hook(engine, int(hang) if hang else None)
    except (OSError, ValueError) as e:  # a message size that cannot carry a block, an arena that does not fit
        raise SystemExit(f"kvrelay {worker_cls.role}: {e}") from None
    port = await worker.start(args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if interrupt.requested():  # Ctrl+C while loading, swallowed by a library (kvrelay.interrupt)
        stop.set()
    print(f"kvrelay {worker.role} listening on {args.host}:{port} model={worker.layout.describe()}", flush=True)
    return await run_until_stopped(worker, stop, args.shutdown_timeout)


async def run_until_stopped(worker: WorkerBase, stop: asyncio.Event, grace_s: float = 5.0) -> int:
    """Serve until stop is set (returns 0) or the engine's step loop crashes (returns 1).

    A worker whose engine died would keep its port open and fail every request sent to it, and
    its tcpSocket readiness probe would keep passing. Exiting instead breaks its load stream, so
    gateways drop it at once and retry its requests elsewhere, and Kubernetes restarts it."""
    stopped = asyncio.create_task(stop.wait())
    dead = asyncio.create_task(worker.engine.wait_dead())
    hung = asyncio.create_task(worker.watchdog.expired.wait())
    await asyncio.wait((stopped, dead, hung), return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if dead.done():
        log.error("kvrelay %s: the engine stopped after an error (%r); exiting so that the worker is restarted",
                  worker.role, dead.result())
        code, grace_s = 1, min(grace_s, 1.0)
    elif hung.done():
        code, grace_s = 1, min(grace_s, 1.0)
    for task in (stopped, dead, hung):
        task.cancel()
    if code and hung.done():
        # The engine thread is stuck: engine.shutdown() would wait for it in vain. Stop serving, then go.
        worker.load.draining = True
        if worker.server is not None:
            await worker.server.stop(grace_s)
        os._exit(1)
    await worker.stop(grace_s=grace_s)
    return code
