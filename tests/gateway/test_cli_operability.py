"""The command line as an operator meets it: one-line start-up errors, clean stops, --version, --help."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from gateway_helpers import GatewayProcess, WorkerProcess

KVRELAY = [sys.executable, "-m", "kvrelay.cli"]


def kvrelay(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*KVRELAY, *args], check=False, capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else os.environ.copy())


def test_version_and_help_with_defaults():
    from kvrelay import __version__

    out = kvrelay("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"kvrelay {__version__}"
    out = kvrelay("serve", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "--port PORT (default: 8000)" in text and "--host HOST address to listen on (default: 127.0.0.1)" in text
    assert "--max-queue MAX_QUEUE requests waiting before 503 (default: 1024)" in text
    assert "at most 10% of the memory available at start-up" in text  # the CPU KV cache rule


@pytest.mark.parametrize("role", ["serve", "prefill", "decode", "gateway", "generate"])
def test_a_model_path_that_is_no_folder_is_one_line_with_the_hub_hint(role):
    extra = ["--port", "0"] if role in ("prefill", "decode") else []
    extra += ["x"] if role == "generate" else []
    if role == "gateway":
        extra += ["--decode", "127.0.0.1:1"]
    out = kvrelay(role, "--model", "meta-llama/Llama-3.2-1B", *extra)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "meta-llama/Llama-3.2-1B: no such folder" in lines[0] and "download it first" in lines[0]


@pytest.mark.parametrize(("value", "says"), [
    ("no-such-template.jinja", "no such file, and not a jinja2 template either"),
    ("{% for m in messages %}{{ m.content }}", "line 1: Unexpected end of template"),
])
@pytest.mark.parametrize("role", ["serve", "gateway"])
def test_a_chat_template_that_cannot_be_used_is_one_line(role, value, says):
    extra = ["--decode", "127.0.0.1:1"] if role == "gateway" else []
    out = kvrelay(role, "--chat-template", value, *extra)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"kvrelay {role}: error: --chat-template") and says in out.stderr


def test_cuda_and_triton_without_cuda_are_one_line():
    import torch

    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("this machine has CUDA")
    out = kvrelay("decode", "--port", "0", "--device", "cuda")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--device cuda: no CUDA device" in out.stderr
    out = kvrelay("serve", "--kernel-backend", "triton")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--kernel-backend triton needs" in out.stderr


@pytest.mark.parametrize("role", ["serve", "decode"])
def test_a_port_in_use_is_one_line_before_the_model_loads(role, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A model folder that would fail to load: the port check must come first.
        (tmp_path / "model").mkdir()
        out = kvrelay(role, "--host", "127.0.0.1", "--port", str(port), "--model", str(tmp_path / "model"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"--port {port}: address 127.0.0.1:{port} is already in use" in out.stderr


def test_operator_without_kubeconfig_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["HOME"] = str(tmp_path)
    out = kvrelay("operator", "--standalone", env=env)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "no Kubernetes credentials" in out.stderr
    env["KUBECONFIG"] = str(tmp_path / "missing")
    out = kvrelay("operator", "--standalone", env=env)
    assert out.returncode == 2 and "missing: no such file" in out.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_stops_on_ctrl_c_and_sigterm_with_code_0_and_no_traceback(sig, tmp_path):
    import httpx

    server = GatewayProcess([], tmp_path / "serve.log")
    try:
        body = {"model": "stories260K", "prompt": "Once upon a time there was a girl named Lily. " * 4,
                "max_tokens": 2}
        for _ in range(2):  # the second request hits the prefix cache
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200

        def metrics() -> dict[str, float]:
            return {line.split()[0]: float(line.split()[1])
                    for line in httpx.get(server.url + "/metrics").text.splitlines() if line.startswith("kvrelay:")}

        deadline = time.monotonic() + 10  # the engine process reports its stats every few hundred ms
        while metrics().get("kvrelay:prefix_cache_hits_total", 0) < 16:
            assert time.monotonic() < deadline, metrics()
            time.sleep(0.1)
        assert metrics()["kvrelay:num_preemptions_total"] == 0
        server.proc.send_signal(sig)
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log


@pytest.mark.parametrize("timeout", ["60", "0"])
def test_sigterm_lets_streams_in_flight_finish_within_the_shutdown_timeout(timeout, tmp_path):
    """A rolling update: SIGTERM while a long stream runs. With time to finish (--shutdown-timeout
    60), the client gets every token and [DONE]; with none (0), the stream is cut. Either way the
    server exits 0."""
    import httpx

    server = GatewayProcess(["--shutdown-timeout", timeout], tmp_path / "serve.log")
    body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 480, "n": 8, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    events: list[str] = []
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            events.append(next(line for line in lines if line.startswith("data: ")))
            server.proc.send_signal(signal.SIGTERM)  # after the first chunk: the stream is in flight
            try:
                events += [line for line in lines if line.startswith("data: ")]
            except httpx.HTTPError:  # the server closed the connection mid-stream
                pass
        assert server.proc.wait(90) == 0
    finally:
        server.stop()
    finished = [json.loads(e[6:])["choices"][0] for e in events if e != "data: [DONE]"]
    finished = [c for c in finished if c["finish_reason"]]
    if timeout == "60":
        assert events[-1] == "data: [DONE]" and len(finished) == 8
        assert {c["finish_reason"] for c in finished} == {"length"}
    else:
        assert events[-1] != "data: [DONE]" and len(finished) < 8


def test_shutdown_delay_keeps_serving_after_sigterm_with_ready_503_and_connection_close(tmp_path):
    """--shutdown-delay: after SIGTERM the gateway still answers new requests (load balancers have not
    taken it out yet), /ready says draining, answers ask clients to reconnect elsewhere; a second
    SIGTERM stops it at once (the delay here is far longer than the test's deadlines)."""
    import httpx

    server = GatewayProcess(["--shutdown-delay", "600"], tmp_path / "serve.log")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            assert client.get("/ready").status_code == 200
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while (ready := client.get("/ready")).status_code == 200:
                assert time.monotonic() < deadline, "/ready never reported draining"
                time.sleep(0.05)
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining"
            r = client.post("/v1/completions", json={"model": "stories260K", "prompt": "Once", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["choices"][0]["text"]
            assert r.headers["connection"] == "close"
            assert server.proc.poll() is None
        server.proc.send_signal(signal.SIGTERM)  # a second signal: no more waiting
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def _stopped(proc: subprocess.Popen, timeout: float, failure: str) -> str:
    """proc's stderr once it exits; an AssertionError with failure and the stderr's tail if it has
    not within timeout seconds."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"{failure}:\n{proc.communicate()[1][-3000:]}") from None


def test_serve_stopped_while_loading_exits_0_without_traceback():
    proc = subprocess.Popen([*KVRELAY, "serve", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    time.sleep(1.5)  # inside imports or the model load
    proc.send_signal(signal.SIGINT)
    # Generous: the stop waits for the engine process, which on a loaded machine may still be importing.
    err = _stopped(proc, 90, "serve did not stop within 90 s of Ctrl+C")
    # 0, or the status of a process stopped by SIGINT (a shell's 130): CPython's exec() of a string
    # marks a KeyboardInterrupt raised inside it as unhandled even when caught, and exits that way at the
    # end (dataclasses build methods with exec, so a Ctrl+C inside fastapi's import does it). Never a traceback.
    assert proc.returncode in (0, -signal.SIGINT) and "Traceback" not in err, (proc.returncode, err)


# Installed as sitecustomize in the serve process only: the first import of the module named in
# SWALLOW_AT gets a Ctrl+C that is caught and dropped, as torch's C initialisation drops one that lands
# in its import of numpy (seen: serve then went on to serve, Ctrl+C lost).
SWALLOWING_SITECUSTOMIZE = '''
import builtins, os, signal, sys
_import = builtins.__import__
_done = []

def _swallowing_import(name, *args, **kwargs):
    if name == os.environ["SWALLOW_AT"] and not _done and sys.argv[0].endswith("cli.py"):
        _done.append(name)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10**7):  # the handler runs within a few bytecodes
                pass
        except KeyboardInterrupt:
            open(os.environ["SWALLOW_LOG"], "w").write("swallowed")
    return _import(name, *args, **kwargs)

builtins.__import__ = _swallowing_import
'''


# torch: during the command modules' imports; kvrelay.engine.core.client: in serve's run, before the
# engine process starts (the stop is then taken just before uvicorn would serve).
@pytest.mark.parametrize("module", ["torch", "kvrelay.engine.core.client"])
def test_serve_stops_on_a_ctrl_c_that_a_library_swallowed_while_loading(tmp_path, module):
    (tmp_path / "sitecustomize.py").write_text(SWALLOWING_SITECUSTOMIZE)
    log = tmp_path / "swallowed"
    env = dict(os.environ, SWALLOW_AT=module, SWALLOW_LOG=str(log),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([*KVRELAY, "serve", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    err = _stopped(proc, 120, "serve went on after a swallowed Ctrl+C")
    assert log.read_text() == "swallowed"  # the Ctrl+C did land inside that import
    assert proc.returncode == 0 and "Traceback" not in err, (proc.returncode, err)
    assert "Uvicorn running" not in err and "Application startup complete" not in err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_worker_stops_on_ctrl_c_and_sigterm_with_code_0(sig):
    worker = WorkerProcess("decode")
    worker.proc.send_signal(sig)
    assert worker.proc.wait(30) == 0
    worker.stderr.seek(0)
    assert "Traceback" not in worker.stderr.read()
    worker.stop()
