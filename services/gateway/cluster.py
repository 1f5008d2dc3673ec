"""`kvrelay gateway`: the cluster role, in front of prefill and decode worker pools.

    kvrelay gateway --prefill HOST:PORT,... --decode HOST:PORT,... --redis-url URL --tenants FILE

Workers come from static lists, or from a headless Service's DNS name
(`dns:///kvrelay-decode.NS.svc.cluster.local:50051`), re-resolved every `--dns-refresh` s.
The gateway reads only the tokenizer and configs from `--model` (no weights).
"""

from __future__ import annotations

import argparse

from kvrelay.engine.engine_args import parse_bytes
from kvrelay.gateway.breaker import BreakerConfig
from kvrelay.gateway.serve import add_gateway_arguments, build_quota, gateway_config, run_app
from kvrelay.gateway.stall import StallConfig
from kvrelay.kvtransfer.layout import DEFAULT_MAX_MESSAGE_BYTES

from kvrelay.log_format import setup_logging
from kvrelay.models import BUNDLED_MODEL


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_gateway_arguments(parser, default_host="0.0.0.0")  # the cluster role listens in its pod
    parser.add_argument("--prefill", default="", help="prefill workers: HOST:PORT,... or dns:///NAME:PORT")
    parser.add_argument("--decode", default="", help="decode workers: HOST:PORT,... or dns:///NAME:PORT")
    parser.add_argument("--model", default=str(BUNDLED_MODEL),
                        help="model folder the workers serve: the gateway reads its tokenizer and configs only")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model id clients use (default: folder name); more names are aliases also accepted and "
                             "listed, answered with the first")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="the LoRA adapters the workers serve (give them the same flag): a request whose model "
                             "is NAME runs with that adapter; the gateway reads only the names")
    parser.add_argument("--dns-refresh", type=float, default=5.0, help="seconds between DNS re-resolutions")
    parser.add_argument("--routing-policy", default=None,
                        help="a routing policy from a kvrelay.routing plugin (default: the built-in prefix-cache "
                             "affinity with bounded load)")
    add_resilience_arguments(parser)
    add_message_size_argument(parser)
    parser.add_argument("--plugins", default=None,
                        help="load only these plugins (comma-separated; default: $KVRELAY_PLUGINS, else all)")


def add_resilience_arguments(parser: argparse.ArgumentParser) -> None:
    """Stall detection and circuit breakers of the gateway in front of workers."""
    s, b = StallConfig(), BreakerConfig()
    parser.add_argument("--stall-timeout", type=float, default=s.max_s,
                        help="longest a started stream may go without a token before it is abandoned (the timeout "
                             f"used is {s.factor:g}x the worker's mean inter-token gap, between {s.min_s:g} s and "
                             "this); a stream whose worker stops reporting its load is abandoned at once; a "
                             "request that got no token yet is retried on another decode worker")
    parser.add_argument("--breaker-failures", type=int, default=b.failure_threshold,
                        help="consecutive failures or stalls of a decode worker that open its circuit breaker")
    parser.add_argument("--breaker-cooldown", type=float, default=b.cooldown_s,
                        help="seconds an open breaker waits before letting one probe request through")


def add_message_size_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-message-bytes", type=parse_bytes, default=DEFAULT_MAX_MESSAGE_BYTES,
                        help="largest gRPC message to and from the decode workers (default 4MiB); give the workers' "
                             "--max-message-bytes, or long prompt-logprobs answers are refused with a 400")


def build_backend(args: argparse.Namespace, prefill: str, decode: str):
    from kvrelay.engine.lora.adapter import parse_lora_modules
    from kvrelay.gateway.disaggregated import DisaggregatedBackend

    names = args.served_model_name or [None]
    return DisaggregatedBackend(prefill, decode, args.model, names[0], model_aliases=tuple(names[1:]),
                                lora_modules=parse_lora_modules(args.lora_modules or []),
                                capacity=args.capacity or 256, dns_refresh_s=args.dns_refresh,
                                routing_policy=getattr(args, "routing_policy", None),
                                stall=StallConfig(max_s=args.stall_timeout),
                                breaker=BreakerConfig(args.breaker_failures, args.breaker_cooldown),
                                max_message_bytes=args.max_message_bytes)


def run(args: argparse.Namespace) -> int:
    from kvrelay.gateway.app import Gateway, create_app
    from kvrelay.gateway.serve import check_runtime_lora, load_tenants

    setup_logging(args.log_level, args.log_format)
    check_runtime_lora(args, role="gateway")
    if not args.decode:
        raise SystemExit("kvrelay gateway: --decode is required (HOST:PORT,... or dns:///NAME:PORT); "
                         "--prefill is optional (decode workers can prefill locally)")
    try:
        backend = build_backend(args, args.prefill, args.decode)
    except ValueError as e:
        raise SystemExit(f"kvrelay gateway: {e}") from e
    gateway = Gateway(backend, load_tenants(args), build_quota(args), gateway_config(args))
    return run_app(create_app(gateway), args)
