"""`kvrelay` command line: one subcommand per role, each defined in its own module.

Each module listed in COMMANDS provides `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("kvrelay.engine.cli_generate", "generate completions for prompts offline"),
    "serve": (
        "kvrelay.gateway.serve",
        "OpenAI-compatible server: gateway + in-process engine, bundled model",
    ),
    "gateway": ("kvrelay.gateway.cluster", "cluster gateway in front of prefill/decode workers"),
    "prefill": ("kvrelay.prefill.cli", "prefill worker: computes prompts' KV cache and hands it to decode workers"),
    "decode": ("kvrelay.decode.cli", "decode worker: pulls prefilled KV blocks over gRPC and generates tokens"),
    "tenants": ("kvrelay.gateway.tenants_cli", "manage a gateway tenants file: `tenants add NAME` makes a new API key"),
    "operator": ("kvrelay.operator.cli", "run the Kubernetes operator for InferenceService resources"),
    "bench": ("kvrelay.bench.cli", "benchmark any OpenAI-compatible server, or the engine offline"),
    "env": ("kvrelay.env_info", "print versions, CUDA, CPU flags, native kernels and plugins (for bug reports)"),
}


# Every process that serves or generates loads the installed plugins at start (kvrelay.plugins).
PLUGIN_COMMANDS = ("generate", "serve", "gateway", "prefill", "decode")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrelay", description="Kubernetes-native LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    if args.command in PLUGIN_COMMANDS:
        from kvrelay.plugins import PluginError, load_plugins

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            load_plugins(getattr(args, "plugins", None))
        except PluginError as exc:
            print(f"kvrelay {args.command}: {exc}", file=sys.stderr)
            return 2
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
