"""`kvrelay serve`: the gateway, and the engine in a process of its own (the README's command).

By default: the bundled model, an open `default` tenant, in-memory quotas. `--tenants FILE`
turns on API keys and quotas; `--redis-url` shares quotas between several such processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml
from kvrelay.engine.cpu_threads import split_cpus
from kvrelay.engine.engine_args import EngineArgs, parse_bytes
from kvrelay.engine.multimodal.config import read_vision_config
from kvrelay.gateway import chat_render, reasoning
from kvrelay.gateway.api_key import ENV as API_KEY_ENV
from kvrelay.gateway.api_key import ApiKeyRegistry
from kvrelay.gateway.app import Gateway, GatewayConfig, create_app
from kvrelay.gateway.backend import LocalBackend
from kvrelay.gateway.frontdoor import FrontDoorLimits, uvicorn_options
from kvrelay.gateway.media import MediaLimits, parse_limit_mm_per_prompt
from kvrelay.gateway.quota import MemoryQuotaStore, QuotaManager, RedisQuotaStore
from kvrelay.gateway.structured.tool_parsers import PARSERS
from kvrelay.gateway.structured.tools import ToolSettings
from kvrelay.gateway.tenants import TenantConfigError, TenantRegistry
from kvrelay.kvtransfer.watchdog import WatchdogConfig
from kvrelay.kvtransfer.worker_base import PARENT_PID_ENV, SHUTDOWN_TIMEOUT_S

from kvrelay import interrupt
from kvrelay.log_format import add_log_arguments, setup_logging

log = logging.getLogger(__name__)

VISION_BODY_BYTES = 32 * 1024 * 1024  # --max-body-bytes' default for vision-language models


def add_gateway_arguments(parser: argparse.ArgumentParser, default_host: str = "127.0.0.1") -> None:
    """Flags shared by `kvrelay serve` and `kvrelay gateway`."""
    d = GatewayConfig()
    parser.add_argument("--host", default=default_host, help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tenants", default=None, metavar="FILE",
                        help="tenants YAML (keys, quotas, priority, models); default: one open tenant")
    parser.add_argument("--api-key", default=None,
                        help=f"one API key for every request, without a tenants file (or ${API_KEY_ENV}, which "
                             "keeps it out of the process list); compared in constant time, never logged")
    parser.add_argument("--redis-url", default=None, help="Redis for quotas shared by all gateway replicas")
    parser.add_argument("--quota-failure-policy", choices=["closed", "open"], default="closed",
                        help="when Redis is unreachable: closed = 503, open = enforce quotas per replica and "
                             "charge what was served to Redis when it returns")
    parser.add_argument("--redis-max-connections", type=int, default=64,
                        help="Redis connections per gateway; more concurrent quota checks queue for one")
    parser.add_argument("--redis-timeout", type=float, default=0.5,
                        help="seconds Redis may take to answer one try of a quota command (two tries)")
    parser.add_argument("--quota-wait", type=float, default=d.quota_wait_s,
                        help="seconds an admission may queue for a free Redis connection before a 503")
    parser.add_argument("--lease-ttl", type=float, default=d.lease_ttl_s,
                        help="seconds before a dead gateway's concurrency slots are freed")
    parser.add_argument("--max-queue", type=int, default=d.max_queue, help="requests waiting before 503")
    parser.add_argument("--capacity", type=int, default=None,
                        help="sequences in flight before requests queue (default: the engine's --max-num-seqs)")
    parser.add_argument("--max-body-bytes", type=int, default=None,
                        help=f"request bodies past it: 413 (default {d.max_body_bytes}; for a vision-language model "
                             f"{VISION_BODY_BYTES}, room for photos as data URLs)")
    parser.add_argument("--max-prompt-bytes", type=int, default=d.max_prompt_bytes,
                        help="UTF-8 bytes of prompt text per request, checked before tokenizing (413 past it)")
    parser.add_argument("--tokenizer-threads", type=int, default=d.tokenizer_threads,
                        help="threads that tokenize prompts and render chat templates off the event loop")
    media = MediaLimits()
    parser.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                        help=f"images a chat request may hold, as vLLM takes it: '{{\"image\": N}}' "
                             f"(default {media.max_images})")
    parser.add_argument("--max-image-bytes", type=int, default=media.max_image_bytes,
                        help="bytes of one encoded image, from a data URL or fetched (400 past it)")
    parser.add_argument("--media-fetch-timeout", type=float, default=media.fetch_timeout_s,
                        help="seconds to fetch one http(s) image URL (400 past it)")
    parser.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                        help="the only hosts http(s) image URLs may name (default: any)")
    parser.add_argument("--allow-special-tokens-in-prompt", action="store_true",
                        help="trusted deployments: special-token text in prompts and messages (e.g. </s>) acts as "
                             "the special token; by default it is plain text")
    f = FrontDoorLimits()
    parser.add_argument("--max-header-bytes", type=int, default=f.max_header_bytes,
                        help="bytes of a request head (request line and headers); larger: refused")
    parser.add_argument("--max-headers", type=int, default=f.max_headers, help="header lines per request (431)")
    parser.add_argument("--header-timeout", type=float, default=f.header_timeout_s,
                        help="seconds a connection has to send a complete request head before it is closed")
    parser.add_argument("--max-connections-per-client", type=int, default=f.max_connections_per_client,
                        help="open connections per client address (0: unlimited; behind a proxy all clients "
                             "share its address)")
    parser.add_argument("--default-reserve-tokens", type=int, default=d.default_reserve_tokens,
                        help="tokens a request without max_tokens reserves per sample against token quotas "
                             "(settled at what it used)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve the full /metrics (per-tenant series) on this port, apart from the API; the "
                             "API port's /metrics sums over tenants and needs a key when --tenants is set")
    parser.add_argument("--no-tenant-metrics", action="store_true",
                        help="no per-tenant series at all (every tenant is counted as `all`)")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                        help="how tool calls are read from the model's text (and written for templates without "
                             f"tool support): {', '.join(sorted(PARSERS))} (hermes also reads Qwen's)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='allow tool_choice "auto" (the model decides; needs --tool-call-parser)')
    parser.add_argument("--reasoning-parser", default=None, choices=reasoning.PARSERS,
                        help="reasoning models: chat answers carry the <think> block in reasoning_content, apart "
                             "from content (deepseek_r1, qwen3)")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="the chat template to use instead of the model's own: a jinja2 file, or the template "
                             "itself in one line (as vLLM takes it)")
    parser.add_argument("--allowed-origins", default="", metavar="ORIGIN,...",
                        help="origins whose browser pages may call the API (CORS), comma-separated, e.g. "
                             "https://app.example.com, or * for any; default: none")
    parser.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S,
                        help="on SIGTERM (after --shutdown-delay), seconds that requests in flight have to finish "
                             "(new connections are refused) before the rest are aborted; keep it under the pod's "
                             "terminationGracePeriodSeconds (30 by default)")
    parser.add_argument("--shutdown-delay", type=float, default=0.0,
                        help="on SIGTERM, seconds the gateway first goes on serving (/ready answers 503, answers "
                             "carry Connection: close) while load balancers take it out, before the "
                             "--shutdown-timeout drain; the operator sets 5 in pods. The grace period must "
                             "cover both")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter load and unload LoRA adapters "
                             "while serving (kvrelay serve, one engine process, no tenants file: any caller may "
                             "name any folder on the server; keep it behind --api-key)")
    parser.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                        help="seconds from a request's arrival to its deadline (a tenant's request_timeout_s caps "
                             "it; 0: none); on expiry every hop aborts it and the client gets a 504, or an SSE "
                             "error event once streaming")
    add_log_arguments(parser)
    parser.add_argument("--stats-interval", type=float, default=10.0,
                        help="serve: seconds between engine stats lines in the log (idle intervals are skipped; "
                             "0: off)")


def build_quota(args: argparse.Namespace) -> QuotaManager:
    store = (RedisQuotaStore(args.redis_url, timeout_s=args.redis_timeout, max_connections=args.redis_max_connections)
             if args.redis_url else MemoryQuotaStore())
    return QuotaManager(store, lease_ttl_s=args.lease_ttl, fail_open=args.quota_failure_policy == "open",
                        wait_s=args.quota_wait)


def media_limits(args: argparse.Namespace) -> MediaLimits:
    try:
        max_images = parse_limit_mm_per_prompt(args.limit_mm_per_prompt)
    except ValueError as e:
        raise SystemExit(f"kvrelay: {e}") from e
    if args.max_image_bytes < 1 or args.media_fetch_timeout <= 0:
        raise SystemExit("kvrelay: --max-image-bytes and --media-fetch-timeout must be positive")
    domains = tuple(args.allowed_media_domains) if args.allowed_media_domains else None
    return MediaLimits(max_images, args.max_image_bytes, args.media_fetch_timeout, domains)


def body_limit(args: argparse.Namespace) -> int:
    """--max-body-bytes, or its default: larger for a vision-language model, whose requests carry images."""
    if args.max_body_bytes is not None:
        return args.max_body_bytes
    model = getattr(args, "model", None)
    if model and Path(model).is_dir() and read_vision_config(Path(model)) is not None:
        return VISION_BODY_BYTES
    return GatewayConfig.max_body_bytes


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit(f"kvrelay: --enable-auto-tool-choice needs --tool-call-parser ({', '.join(sorted(PARSERS))})")
    return GatewayConfig(max_queue=args.max_queue, capacity=args.capacity, max_body_bytes=body_limit(args),
                         lease_ttl_s=args.lease_ttl, quota_fail_open=args.quota_failure_policy == "open",
                         quota_wait_s=args.quota_wait, max_prompt_bytes=args.max_prompt_bytes,
                         tokenizer_threads=args.tokenizer_threads,
                         allow_special_tokens=args.allow_special_tokens_in_prompt,
                         tenant_metrics=not args.no_tenant_metrics,
                         default_reserve_tokens=args.default_reserve_tokens,
                         tools=ToolSettings(args.tool_call_parser, args.enable_auto_tool_choice),
                         request_timeout_s=args.request_timeout or None,
                         chat_template=chat_render.load_template(args.chat_template) if args.chat_template else None,
                         reasoning_parser=args.reasoning_parser,
                         allowed_origins=[o.strip() for o in args.allowed_origins.split(",") if o.strip()],
                         runtime_lora=args.allow_runtime_lora_updating,
                         media=media_limits(args),
                         frontdoor=FrontDoorLimits(args.max_header_bytes, args.max_headers, args.header_timeout,
                                                   args.max_connections_per_client))


def run_app(app, args: argparse.Namespace, watch: list[tuple[str, subprocess.Popen]] = (), backend=None,
            supervisor=None) -> int:
    """Serve app until SIGTERM/SIGINT (returns 0), or return 1: when a process in watch exits (the
    engine-core process), when the in-process engine of backend stops after an error or its watchdog
    gives up on a hung step loop, or when supervisor (`serve --disaggregated`'s local workers)
    cannot bring a worker back."""
    import uvicorn
    from kvrelay.gateway.drain import DrainingServer

    limits = app.state.gateway.config.frontdoor
    # log_config=None: uvicorn's loggers go through the root handler (setup_logging: text or JSON).
    gateway = app.state.gateway
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False, timeout_graceful_shutdown=args.shutdown_timeout,
                                           log_config=None, **uvicorn_options(limits)),
                            args.shutdown_delay, on_drain=lambda: setattr(gateway, "draining", True))
    lost: list[str] = []
    backend = gateway.backend

    def watch_engine() -> None:
        """serve's own engine: exit (code 1) once its watchdog gives up on a hung step loop."""
        while not server.should_exit:
            watchdog = getattr(backend, "watchdog", None)
            if watchdog is not None and watchdog.expired.is_set():
                lost.append("engine")
                server.should_exit = True
            time.sleep(0.25)

    threading.Thread(target=watch_engine, daemon=True).start()

    def wait_for(role: str, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not server.should_exit:
            log.error("kvrelay serve: the local %s worker exited with code %s; stopping", role, code)
            lost.append(role)
            server.should_exit = True  # read by uvicorn's main loop on its next tick

    for role, proc in watch:
        threading.Thread(target=wait_for, args=(role, proc), daemon=True).start()

    def engine_died(error: BaseException) -> None:
        if not server.should_exit:
            log.error("kvrelay serve: the engine stopped after an error; exiting: %s", error)
            lost.append("engine")
            server.should_exit = True

    if backend is not None:
        backend.on_dead = engine_died

    def give_up(role: str) -> None:
        lost.append(role)
        server.should_exit = True  # read by uvicorn's main loop on its next tick

    if supervisor is not None:
        supervisor.on_give_up = give_up
    metrics_server = None
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        metrics_server, _ = start_http_server(args.metrics_port, addr=args.host,
                                              registry=app.state.gateway.metrics.registry)
    try:
        if interrupt.requested():  # Ctrl+C while loading, swallowed by a library (kvrelay.interrupt)
            return 0
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl+C it already handled: a clean stop
        pass
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
    return 1 if lost else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_gateway_arguments(parser)
    parser.add_argument("--disaggregated", action="store_true",
                        help="run one prefill and one decode worker process locally and route through them")
    parser.add_argument("--engine-in-process", action="store_true",
                        help="run the engine's step loop in the API process instead of a process of its own "
                             "(they then share one GIL: higher added latency; for debugging)")
    parser.add_argument("--kv-shm-bytes", type=parse_bytes, default=0,
                        help="with --disaggregated: hand K/V over through a shared-memory arena of this size in "
                             "/dev/shm (e.g. 256MiB) instead of inline on gRPC; 0: off")
    parser.add_argument("--max-worker-restarts", type=int, default=5,
                        help="with --disaggregated: consecutive failed restarts of a local worker before serve exits "
                             "with code 1 (0: exit when a worker dies)")
    parser.add_argument("--kv-shared-cache", action="store_true",
                        help="with --kv-shm-bytes: the prefill worker keeps its KV cache in /dev/shm and the "
                             "decode worker copies blocks straight out of it (CPU only)")
    from kvrelay.gateway.cluster import add_message_size_argument, add_resilience_arguments

    add_resilience_arguments(parser)
    add_message_size_argument(parser)  # with --disaggregated: the workers' limit too
    w = WatchdogConfig()
    parser.add_argument("--watchdog-timeout", type=float, default=w.timeout_s,
                        help="the engine's step loop counts as hung after this many seconds without progress (or "
                             "100 mean step times, if longer): /ready and /health answer 503")
    parser.add_argument("--watchdog-grace", type=float, default=w.grace_s,
                        help="seconds serve stays up with a hung engine before it exits with code 1")
    EngineArgs.add_cli_args(parser)


def check_runtime_lora(args: argparse.Namespace, role: str = "serve") -> None:
    """--allow-runtime-lora-updating works where one engine process serves, and no tenants file
    grants access (any caller could load any folder of the server)."""
    if not args.allow_runtime_lora_updating:
        return
    if role != "serve" or getattr(args, "disaggregated", False):
        raise SystemExit("kvrelay: --allow-runtime-lora-updating needs `kvrelay serve` with its own engine; "
                         "across workers, name the adapters with --lora-modules on every role")
    if args.tenants:
        raise SystemExit("kvrelay: --allow-runtime-lora-updating lets any caller load a folder of this server: "
                         "not with --tenants (use --api-key, or --lora-modules)")
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        raise SystemExit("kvrelay: --allow-runtime-lora-updating needs the model in one process (no tensor or "
                         "pipeline parallelism); name the adapters with --lora-modules instead")


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    check_runtime_lora(args)
    if args.disaggregated:
        return run_disaggregated(args)
    # One CPU stays with the API process: an engine on every core is slowed by each chunk it writes.
    engine_args = dataclasses.replace(EngineArgs.from_cli(args), reserved_cpus=1,
                                      enable_lora=args.enable_lora or args.allow_runtime_lora_updating)
    watchdog = WatchdogConfig(args.watchdog_timeout, grace_s=args.watchdog_grace)
    if args.engine_in_process:
        backend = LocalBackend(engine_args, watchdog=watchdog, stats_interval_s=args.stats_interval)
        gateway = Gateway(backend, load_tenants(args), build_quota(args), gateway_config(args))
        return run_app(create_app(gateway), args, backend=backend)
    from kvrelay.engine.core.client import EngineProcess

    tenants = load_tenants(args)  # its errors first, before a model loads
    process = EngineProcess.start(engine_args, args.log_level, watchdog, args.log_format)
    try:
        backend = LocalBackend(engine_args, process, stats_interval_s=args.stats_interval)
        gateway = Gateway(backend, tenants, build_quota(args), gateway_config(args))
        return run_app(create_app(gateway), args, [("engine", process)])
    finally:
        process.stop()


def load_tenants(args: argparse.Namespace) -> TenantRegistry:
    key = args.api_key or os.environ.get(API_KEY_ENV)
    if key:
        if args.tenants:
            raise SystemExit("kvrelay: --api-key and --tenants exclude each other: give the key a tenant in the file "
                             "(`kvrelay tenants add`)")
        try:
            return ApiKeyRegistry(key)
        except ValueError as e:
            raise SystemExit(f"kvrelay: {e}") from None
    try:
        return TenantRegistry(args.tenants)
    except (OSError, TenantConfigError, yaml.YAMLError) as e:
        raise SystemExit(f"kvrelay: cannot load the tenants file: {e}") from e


def start_worker(role: str, args: argparse.Namespace, port: int = 0) -> subprocess.Popen:
    """`kvrelay prefill|decode` on loopback (port 0: any free port); returns once it listens."""
    cmd = [sys.executable, "-m", "kvrelay.cli", role, "--host", "127.0.0.1", "--port", str(port),
           *EngineArgs.cli_flags(args)]
    if args.cpu_threads is None and not os.environ.get("OMP_NUM_THREADS"):
        # Two engines and the gateway on one machine: the gateway keeps a CPU, the workers split the rest.
        cmd += ["--cpu-threads", str(split_cpus(2, reserved=1))]
    if role == "decode":
        cmd += ["--kv-shm-bytes", str(args.kv_shm_bytes)]
    elif args.kv_shared_cache and args.kv_shm_bytes:
        cmd += ["--kv-shared-cache"]
    cmd += ["--max-message-bytes", str(args.max_message_bytes),
            "--watchdog-timeout", str(args.watchdog_timeout), "--watchdog-grace", str(args.watchdog_grace),
            "--log-level", args.log_level, "--log-format", args.log_format,
            "--stats-interval", str(args.stats_interval)]
    # uvicorn re-raises the SIGTERM it handled once it has shut down, so the finally in
    # run_disaggregated may never run: the workers also stop by themselves when serve exits.
    env = os.environ | {PARENT_PID_ENV: str(os.getpid())}
    # Its own session: a Ctrl+C in the terminal reaches serve alone, which then stops the workers
    # (a worker stopping by itself would look like a crash to the supervisor).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    for line in proc.stdout:  # the worker prints "kvrelay <role> listening on HOST:PORT ..."
        if " listening on " in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining its output
            return proc
    raise RuntimeError(f"the {role} worker exited with {proc.wait()} before listening")


def run_disaggregated(args: argparse.Namespace) -> int:
    from kvrelay.gateway.cluster import build_backend
    from kvrelay.gateway.supervisor import RestartPolicy, Supervisor

    if getattr(args, "runner", "auto") == "pooling":
        raise SystemExit("kvrelay serve --disaggregated: an embedding model (--runner pooling) has no decode phase "
                         "to hand over; drop --disaggregated")
    if getattr(args, "nnodes", 1) > 1:  # two local engines cannot both be node 0 of one rendezvous
        raise SystemExit("kvrelay serve --disaggregated: --nnodes > 1 is for one engine (serve, prefill or decode)")
    supervisor = Supervisor(["prefill", "decode"], lambda role, port: start_worker(role, args, port),
                            RestartPolicy(max_restarts=args.max_worker_restarts))
    try:
        try:
            supervisor.start_all()
        except RuntimeError as e:
            raise SystemExit(f"kvrelay serve --disaggregated: {e}") from None
        args.dns_refresh = 5.0
        backend = build_backend(args, supervisor.addresses["prefill"], supervisor.addresses["decode"])
        gateway = Gateway(backend, load_tenants(args), build_quota(args), gateway_config(args))
        return run_app(create_app(gateway), args, supervisor=supervisor)
    finally:
        supervisor.stop()
