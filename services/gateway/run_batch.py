"""`kvrelay run-batch`: OpenAI's batch file format, offline, as `vllm run-batch` runs it.

Each input line is `{"custom_id", "method": "POST", "url", "body"}` for one of URLS; each output
line, in the input's order, `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`. The requests go through the gateway's own app in this process (httpx's ASGI transport,
no socket), so a batch line is validated, tokenized, queued and answered exactly as over HTTP; the
engine runs in this process too. A line that is not a request (bad JSON, another method or URL, a
stream) gets `error` and no `response`; a request the server refuses gets its status and error body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from pathlib import Path

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/score", "/v1/rerank", "/v1/classify")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvrelay.engine.engine_args import EngineArgs

    parser.add_argument("-i", "--input-file", required=True, help="the batch: one JSON request per line")
    parser.add_argument("-o", "--output-file", required=True, help="where the answers go, one JSON line each")
    parser.add_argument("--max-concurrency", type=int, default=256,
                        help="requests in flight at once (the engine batches them; at most 1024)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.max_concurrency <= 1024:
        raise SystemExit(f"kvrelay run-batch: --max-concurrency must be in [1, 1024], got {args.max_concurrency}")
    source = Path(args.input_file)
    if not source.is_file():
        raise SystemExit(f"kvrelay run-batch: {source}: no such file")
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    from kvrelay.engine.engine_args import EngineArgs

    results = asyncio.run(_run_all(EngineArgs.from_cli(args), lines, args.max_concurrency))
    Path(args.output_file).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    failed = sum(r["error"] is not None or r["response"]["status_code"] != 200 for r in results)
    print(f"kvrelay run-batch: {len(results)} requests, {len(results) - failed} succeeded, {failed} failed; "
          f"answers in {args.output_file}", file=sys.stderr)
    return 0


async def _run_all(engine_args, lines: list[str], concurrency: int) -> list[dict]:
    import httpx
    from kvrelay.gateway.app import Gateway, GatewayConfig, create_app
    from kvrelay.gateway.backend import LocalBackend
    from rich.progress import Progress

    # No deadline: a batch may queue for as long as the file takes.
    app = create_app(Gateway(LocalBackend(engine_args), config=GatewayConfig(request_timeout_s=None)))
    slots = asyncio.Semaphore(concurrency)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://batch", timeout=None) as client:
        with Progress(transient=True) as progress:
            task = progress.add_task("requests", total=len(lines))

            async def one(line: str) -> dict:
                async with slots:
                    result = await _answer(client, line)
                progress.advance(task)
                return result

            return await asyncio.gather(*(one(line) for line in lines))


def _line_error(custom_id, code: str, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


async def _answer(client, line: str) -> dict:
    try:
        request = json.loads(line)
    except json.JSONDecodeError as e:
        return _line_error(None, "invalid_json", f"the line is not JSON: {e}")
    if not isinstance(request, dict):
        return _line_error(None, "invalid_request", "each line must be a JSON object")
    custom_id, url, body = request.get("custom_id"), request.get("url"), request.get("body")
    if request.get("method", "POST") != "POST":
        return _line_error(custom_id, "invalid_request", f"method must be POST, got {request.get('method')!r}")
    if url not in URLS:
        return _line_error(custom_id, "invalid_url", f"url must be one of {', '.join(URLS)}, got {url!r}")
    if not isinstance(body, dict):
        return _line_error(custom_id, "invalid_request", "body must be a JSON object")
    if body.get("stream"):
        return _line_error(custom_id, "invalid_request", "stream: a batch answers each request whole; drop it")
    response = await client.post(url.replace("/v1/classify", "/classify"), json=body)
    try:
        answer = response.json()
    except ValueError:
        answer = {"error": {"message": response.text[:500]}}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": response.status_code,
                         "request_id": response.headers.get("x-request-id") or answer.get("id"), "body": answer},
            "error": None}
