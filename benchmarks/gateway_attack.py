"""The front door under the attacks of issue 19, against one `kvrelay serve` process (bundled model).

Prints, per probe:
  big prompts    8 concurrent ~2 MB prompts: /health latency (p50, max) while they are in flight
  huge headers   3 requests with a 100 MB Authorization header: the server's RSS growth
  half-open      1100 connections that never finish their request head: how many the server
                 still holds after --header-timeout + 2 s

    .venv/bin/python benchmarks/gateway_attack.py [--header-timeout 3] [extra serve flags]

The same probes against the gateway before issue 19 gave: /health silent for about 5 s, RSS
+380 MB never returned, and all 1,100 half-open connections held.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

from common import free_port, stop_process

BIG = 2_000_000


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def get(url: str, timeout: float = 30) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


def post(url: str, body: dict, timeout: float = 600) -> int:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def start(args, extra: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvrelay.cli", "serve", "--port", str(port), "--log-level", "warning",
           "--max-body-bytes", str(3 * BIG), "--max-prompt-bytes", str(BIG + 1000), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if get(f"http://127.0.0.1:{port}/ready", 1) == 200:
                return proc, port
        except OSError:
            time.sleep(0.2)
    raise SystemExit("kvrelay serve did not start")


def big_prompts(port: int) -> str:
    words = ["once", "upon", "a", "time", "there", "was", "a", "little", "girl", "named", "lily"]
    prompt = " ".join(random.Random(0).choice(words) for _ in range(BIG // 4))[:BIG]
    body = {"model": "stories260K", "prompt": prompt, "max_tokens": 1}
    threads = [threading.Thread(target=post, args=(f"http://127.0.0.1:{port}/v1/completions", body))
               for _ in range(8)]
    for t in threads:
        t.start()
    latencies = []
    while any(t.is_alive() for t in threads):
        t0 = time.perf_counter()
        get(f"http://127.0.0.1:{port}/health", 60)
        latencies.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.02)
    return (f"big prompts   /health p50 {statistics.median(latencies):7.1f} ms   max {max(latencies):7.1f} ms   "
            f"({len(latencies)} polls)")


def huge_headers(proc: subprocess.Popen, port: int) -> str:
    before = rss_mib(proc.pid)
    chunk = b"a" * (1 << 20)
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nauthorization: Bearer ")
            try:
                for _ in range(100):
                    s.sendall(chunk)
                s.sendall(b"\r\n\r\n")
                s.settimeout(60)
                s.recv(100)
            except OSError:
                pass
    time.sleep(1)
    return f"huge headers  RSS {before:.0f} MiB -> {rss_mib(proc.pid):.0f} MiB"


def half_open(port: int, header_timeout: float) -> str:
    socks = []
    for _ in range(1100):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
            socks.append(s)
        except OSError:
            break
    time.sleep(header_timeout + 2)
    held = 0
    for s in socks:
        s.setblocking(False)
        try:
            held += s.recv(1) != b""
        except BlockingIOError:
            held += 1  # nothing to read and not closed: still held
        except OSError:
            pass
        s.close()
    return f"half-open     {len(socks)} opened, {held} still held after {header_timeout + 2:.0f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--header-timeout", type=float, default=3.0)
    args, extra = parser.parse_known_args()
    proc, port = start(args, extra + ["--header-timeout", str(args.header_timeout)])
    try:
        print(big_prompts(port), flush=True)
        print(huge_headers(proc, port), flush=True)
        print(half_open(port, args.header_timeout), flush=True)
    finally:
        stop_process(proc)


if __name__ == "__main__":
    main()
