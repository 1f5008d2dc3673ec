"""`kvrelay` command line: one subcommand per role, each defined in its own module.

Each module listed in COMMANDS provides `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from kvrelay import interrupt

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("kvrelay.engine.cli_generate", "generate completions for prompts offline"),
    "serve": (
        "kvrelay.gateway.serve",
        "OpenAI-compatible server: gateway + in-process engine, bundled model",
    ),
    "run-batch": ("kvrelay.gateway.run_batch", "answer a file of OpenAI batch requests offline (vLLM's run-batch)"),
    "gateway": ("kvrelay.gateway.cluster", "cluster gateway in front of prefill/decode workers"),
    "prefill": ("kvrelay.prefill.cli", "prefill worker: computes prompts' KV cache and hands it to decode workers"),
    "decode": ("kvrelay.decode.cli", "decode worker: pulls prefilled KV blocks over gRPC and generates tokens"),
    "tenants": ("kvrelay.gateway.tenants_cli", "manage a gateway tenants file: `tenants add NAME` makes a new API key"),
    "parallel-worker": ("kvrelay.engine.parallel.cli_worker",
                        "host a node's tensor/pipeline-parallel ranks for an engine on node 0 (--nnodes > 1)"),
    "operator": ("kvrelay.operator.cli", "run the Kubernetes operator for InferenceService resources"),
    "bench": ("kvrelay.bench.cli", "benchmark any OpenAI-compatible server, or the engine offline"),
    "env": ("kvrelay.env_info", "print versions, CUDA, CPU flags, native kernels and plugins (for bug reports)"),
}


# Every process that serves or generates loads the installed plugins at start (kvrelay.plugins).
PLUGIN_COMMANDS = ("generate", "serve", "run-batch", "gateway", "prefill", "decode")


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Appends "(default: X)" to each option's help, unless the help already names its default or
    there is none to show (None, False, an empty string)."""
    for action in parser._actions:
        text = action.help or ""
        if (text == argparse.SUPPRESS or "default" in text or not action.option_strings
                or action.default in (None, False, "", [], argparse.SUPPRESS)):
            continue
        action.help = f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def _stop_on_sigterm(signum, frame) -> None:
    # SIGTERM takes the same clean way out as Ctrl+C: finally blocks run, no traceback (main()).
    interrupt.request()
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    interrupt.install()
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl+C or SIGTERM before a role installed its own handlers
        return 0


def _main(argv: list[str] | None) -> int:
    from kvrelay import __version__

    parser = argparse.ArgumentParser(prog="kvrelay", description="Kubernetes-native LLM inference")
    parser.add_argument("--version", action="version", version=f"kvrelay {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # Only the command asked for is imported (the top-level parser has no option that takes a
    # value, so the first word is the command): a worker starts without the gateway's web stack,
    # and on images that lack it. `kvrelay --help` and unknown commands import them all.
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    chosen = words[0] if words and words[0] in COMMANDS else None
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        if chosen is not None and name != chosen:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        modules[name] = module
        module.add_arguments(command := sub.add_parser(name, help=help_text, description=help_text))
        show_defaults(command)
    if interrupt.requested():  # a Ctrl+C that an import swallowed (kvrelay.interrupt)
        return 0
    args = parser.parse_args(argv)
    from kvrelay.preflight import StartupError, check

    try:
        check(args.command, args)
    except StartupError as exc:
        print(f"kvrelay {args.command}: error: {exc}", file=sys.stderr)
        return 2
    if args.command in PLUGIN_COMMANDS:
        from kvrelay.log_format import setup_logging
        from kvrelay.plugins import PluginError, load_plugins

        setup_logging(getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))
        try:
            load_plugins(getattr(args, "plugins", None))
        except PluginError as exc:
            print(f"kvrelay {args.command}: {exc}", file=sys.stderr)
            return 2
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
