"""`kvrelay bench serve`: load an OpenAI-compatible server and report what its clients see.

    kvrelay bench serve --base-url http://127.0.0.1:8000 --dataset random --num-prompts 200 \\
        --request-rate 1,4,16 --slo ttft=0.5,tpot=0.05 --result-file run.json --plot run.png
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvrelay.bench import datasets
from kvrelay.bench.client import ClientConfig, ServerUnreachable, make_http_client, preflight
from kvrelay.bench.load import LoadShape, Run, Tenant, Workload, parse_tenant, run_load, warm_up
from kvrelay.bench.report import entry, print_entry, sweep_table, write_result
from kvrelay.bench.server_metrics import Sampler, ServerMetrics, metrics_url
from kvrelay.bench.stats import parse_slo, summarize

DEFAULT_NUM_PROMPTS = 100


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '2h', '1.5m' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (examples: 45s, 30m, 2h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def _float_list(text: str) -> list[float]:
    try:
        values = [math.inf if v.strip().lower() == "inf" else float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number, inf, or a comma list of them: {text!r}"
        ) from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"rates must be positive: {text!r}")
    return values


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or a comma list of them: {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"concurrencies must be at least 1: {text!r}")
    return values


def _fraction(text: str) -> float:
    """'0.2' or '20%' -> 0.2"""
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction or a percentage: {text!r}") from None


def _image_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"kvrelay bench: --random-image-size {text!r}: expected WxH, e.g. 336x336") from None
    if w < 1 or h < 1:
        raise SystemExit("kvrelay bench: --random-image-size: both sides must be positive")
    return w, h


def add_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    s.add_argument("--api-key", default=None, help="bearer key (default: none; see --tenant for several)")
    s.add_argument(
        "--model", default=None, help="model to ask for (default: the server's first in /v1/models)"
    )
    s.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME",
        help="LoRA adapters the server serves (by name): request k asks for the k-th mod n of them "
        "instead of --model, so the load spreads evenly over the adapters",
    )
    s.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="model folder whose tokenizer counts prompt tokens (default: the server's usage)",
    )
    s.add_argument(
        "--endpoint",
        default=None,
        help="/v1/completions (default), /v1/chat/completions (default for --dataset conversation) or "
        "/v1/embeddings (an embedding model: latency is reported as TTFT)",
    )
    s.add_argument(
        "--random-images", type=int, default=0, metavar="N",
        help="chat requests carry N random pictures each, as data URLs (vision-language models)",
    )
    s.add_argument("--random-image-size", default="336x336", metavar="WxH", help="the pictures' size")
    s.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask for exactly max_tokens tokens (kvrelay, vLLM, SGLang; hosted APIs ignore it)",
    )
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    s.add_argument(
        "--max-retries-429",
        type=int,
        default=2,
        help="retries of a 429 answer, each after the server's Retry-After (1 s when absent)",
    )
    s.add_argument("--max-retry-wait", type=float, default=30.0, help="cap on one Retry-After wait (s)")
    s.add_argument(
        "--metrics-url", default=None, help="the server's Prometheus metrics (default: BASE/metrics)"
    )
    s.add_argument("--metrics-interval", type=float, default=1.0, help="seconds between /metrics scrapes")
    s.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="read the RSS of this local server process from /proc (servers that do not export it)",
    )
    datasets.add_dataset_arguments(p)
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=_float_list,
        default=[math.inf],
        help="sessions per second (inf: all at once); a comma list sweeps, e.g. 1,2,4",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of arrival gaps: 1 Poisson, <1 burstier, >1 more regular",
    )
    g.add_argument(
        "--max-concurrency",
        type=_int_list,
        default=[None],
        help="requests in flight at most; a comma list sweeps, e.g. 1,4,16",
    )
    g.add_argument(
        "--duration",
        type=parse_duration,
        default=None,
        help="send for this long (45s, 10m) instead of --num-prompts",
    )
    g.add_argument(
        "--warmup",
        "--num-warmups",
        dest="warmup",
        type=int,
        default=0,
        help="requests sent first and not measured",
    )
    g.add_argument(
        "--tenant",
        action="append",
        type=str,
        default=[],
        metavar="NAME:KEY[:WEIGHT]",
        help="a tenant's API key and share of the requests; repeat for a mix",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--slo", default=None, help="goodput SLOs in seconds, e.g. ttft=0.5,tpot=0.05 (also itl, e2e)"
    )
    o.add_argument(
        "--cost-per-hour", type=float, default=None, help="the server's price per hour: cost per 1M tokens"
    )
    o.add_argument(
        "--result-file", default=None, help="JSON: configuration, summary and every request's timings"
    )
    o.add_argument(
        "--plot", default=None, metavar="PNG", help="latency CDFs and throughput vs load (kvrelay[bench])"
    )
    o.add_argument("--no-progress", action="store_true", help="no live progress bar")
    k = p.add_argument_group("stability (soak)")
    k.add_argument(
        "--soak",
        type=parse_duration,
        default=None,
        help="hold the load this long (30m, 2h) and report every --report-interval",
    )
    k.add_argument(
        "--report-interval", type=parse_duration, default=60.0, help="soak report period (default 60s)"
    )
    k.add_argument("--max-error-rate", type=_fraction, default=0.01, help="soak fails past this error rate")
    k.add_argument(
        "--max-rss-growth",
        type=_fraction,
        default=None,
        help="soak fails when the server's RSS grows more than this (0.2 or 20%%) from the first report",
    )


def load_shapes(args: argparse.Namespace) -> list[LoadShape]:
    rates, concs = args.request_rate, args.max_concurrency
    if len(rates) > 1 and len(concs) > 1:
        raise ValueError("sweep one of --request-rate or --max-concurrency, not both")
    return [LoadShape(rate, args.burstiness, conc) for rate in rates for conc in concs]


def config_of(args: argparse.Namespace, model: str, endpoint: str, tenants: list[Tenant]) -> dict:
    skip = {"api_key", "tenant", "bench_run", "bench_command", "command"}
    cfg = {k: v for k, v in vars(args).items() if k not in skip}
    cfg["request_rate"] = [None if math.isinf(r) else r for r in args.request_rate]
    cfg["model"], cfg["endpoint"] = model, endpoint
    cfg["tenants"] = [{"name": t.name, "weight": t.weight} for t in tenants]  # never the keys
    return cfg


class LiveProgress:
    """A rich progress bar of finished requests (or of elapsed time under --duration)."""

    def __init__(self, console: Console, enabled: bool):
        self.enabled = enabled and console.is_terminal
        self.progress = (
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[errors]} errors"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
            if self.enabled
            else None
        )

    def __enter__(self):
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.progress:
            self.progress.stop()

    def task(self, label: str, total: float | None):
        if not self.progress:
            return lambda r: None
        task = self.progress.add_task(label, total=total, errors=0)
        errors = 0

        def done(r) -> None:
            nonlocal errors
            errors += 0 if r.ok else 1
            self.progress.update(task, advance=1, errors=errors)

        return done


async def bench_serve(args: argparse.Namespace, console: Console) -> int:
    if args.tokenizer is None and args.model and (Path(args.model) / "tokenizer.json").is_file():
        args.tokenizer = args.model
    if args.plot:  # before the run, not after it
        from kvrelay.bench.plot import check_matplotlib

        check_matplotlib()
    tokenizer = datasets.load_tokenizer(args.tokenizer)
    tenants = [parse_tenant(t) for t in args.tenant]
    model = await preflight(args.base_url, tenants[0].api_key if tenants else args.api_key, args.model)
    endpoint = args.endpoint or (
        "/v1/chat/completions" if args.dataset == "conversation" else "/v1/completions"
    )
    if endpoint.rstrip("/").endswith("embeddings") and args.dataset == "conversation":
        raise SystemExit("kvrelay bench serve: --endpoint /v1/embeddings sends prompts; the conversation dataset "
                         "is chat turns")
    client = ClientConfig(
        base_url=args.base_url,
        model=model,
        endpoint=endpoint,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        timeout_s=args.request_timeout,
        max_retries_429=args.max_retries_429,
        max_retry_wait_s=args.max_retry_wait,
        models=tuple(args.lora_modules or ()),
        images=args.random_images,
        image_size=_image_size(args.random_image_size),
    )
    if client.images and not client.chat:
        raise SystemExit("kvrelay bench: --random-images needs --endpoint /v1/chat/completions")
    duration = args.soak or args.duration
    num = args.num_prompts if args.num_prompts is not None else (None if duration else DEFAULT_NUM_PROMPTS)
    sessions = datasets.load_dataset(datasets.config_from_args(args, num or DEFAULT_NUM_PROMPTS), tokenizer)
    work = Workload(sessions, client, tenants, tokenizer, args.seed)
    slo = parse_slo(args.slo)
    shapes = load_shapes(args)
    metrics_key = tenants[0].api_key if tenants else args.api_key
    server = ServerMetrics(metrics_url(args.base_url, args.metrics_url), args.server_pid, api_key=metrics_key)
    console.print(
        f"[bold]kvrelay bench[/] {args.base_url} model {model!r}, {endpoint}, dataset {args.dataset}, "
        f"{len(shapes)} load level(s)"
    )
    config = config_of(args, model, endpoint, tenants)
    async with make_http_client(client) as http:
        if args.soak:
            from kvrelay.bench.soak import run_soak

            return await run_soak(http, work, shapes[0], args, server, slo, console, config)
        await warm_up(http, work, args.warmup, shapes[0].max_concurrency)
        entries = []
        with LiveProgress(console, not args.no_progress) as live:
            for shape in shapes:
                total = sum(len(s.turns) for s in sessions) if duration is None else None
                on_done = live.task(shape.label(), total)
                sampler = Sampler(server, args.metrics_interval)
                run = Run(shape)
                await sampler.start(http)
                await run_load(http, work, shape, num, duration, on_done, run)
                await sampler.stop(http)
                summary = summarize(run.results, run.duration_s, slo, args.cost_per_hour)
                entries.append(entry(run, summary, sampler.summary()))
    for e in entries:
        print_entry(console, e)
    if len(entries) > 1:
        console.print(sweep_table(entries))
    if args.result_file:
        write_result(args.result_file, config, entries)
        console.print(f"result file: {args.result_file}")
    if args.plot:
        from kvrelay.bench.plot import plot_runs

        plot_runs(entries, args.plot)
        console.print(f"plot: {args.plot}")
    return 0 if any(e["summary"]["completed"] for e in entries) else 1


def run(args: argparse.Namespace) -> int:
    # Piped into a file, rich would wrap the tables at 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=120)
    try:
        return asyncio.run(bench_serve(args, console))
    except ServerUnreachable as e:
        print(f"kvrelay bench: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"kvrelay bench: {e}", file=sys.stderr)
        return 2
