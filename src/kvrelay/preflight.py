"""Start-up checks run before any role loads a model: each failure is one line, not a traceback.

A port already taken, a model path that is not a folder, or CUDA asked for where there is none
would otherwise surface only after seconds of loading, as an exception deep in torch or uvicorn.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
from pathlib import Path


class StartupError(Exception):
    """A configuration that cannot start; str() is the one line shown to the user."""


def check_model_path(model: str, flag: str = "--model") -> None:
    path = Path(model)
    if path.is_dir():
        return
    if path.exists():
        raise StartupError(f"{flag} {model}: not a folder (give the folder holding config.json and the weights)")
    hint = ""
    if "/" in model and not model.startswith(("/", ".", "~")) and model.count("/") == 1:
        hint = (f"; it looks like a Hugging Face hub id: download it first (e.g. `hf download {model} "
                f"--local-dir ./{model.split('/')[1]}`) and pass the folder")
    raise StartupError(f"{flag} {model}: no such folder{hint}")


def check_device(device: str, kernel_backend: str) -> None:
    if device != "cuda" and kernel_backend != "triton":
        return
    import torch

    if torch.cuda.is_available():
        return
    if device == "cuda":
        raise StartupError("--device cuda: no CUDA device is available here (torch "
                           f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); use --device cpu")
    if device != "cpu":  # auto resolves to CPU here, where the Triton kernels cannot run
        raise StartupError("--kernel-backend triton needs a CUDA device, and none is available here; "
                           "use --kernel-backend auto (native or torch kernels on CPU)")
    raise StartupError("--kernel-backend triton needs --device cuda; on CPU use --kernel-backend auto")


def check_port_free(host: str, port: int | None, flag: str = "--port") -> None:
    """Bind and release at once: the server binds again later (SO_REUSEADDR, as uvicorn and gRPC do)."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise StartupError(f"{flag} {port}: address {host}:{port} is already in use") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise StartupError(f"--host {host}: not an address of this machine") from None
            if e.errno == errno.EACCES:
                raise StartupError(f"{flag} {port}: permission denied (ports below 1024 need privileges)") from None
            raise StartupError(f"{flag} {port} on {host}: {e.strerror}") from None
        except socket.gaierror as e:
            raise StartupError(f"--host {host}: {e.strerror}") from None


def check_kubeconfig() -> None:
    """kopf logs in from $KUBECONFIG, ~/.kube/config or the pod's service account."""
    if os.environ.get("KUBERNETES_SERVICE_HOST") and Path("/var/run/secrets/kubernetes.io/serviceaccount/token").exists():
        return
    paths = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    if paths:
        if any(Path(p).is_file() for p in paths):
            return
        raise StartupError(f"$KUBECONFIG={os.environ['KUBECONFIG']}: no such file; point it at a kubeconfig")
    if (Path.home() / ".kube" / "config").is_file():
        return
    raise StartupError("no Kubernetes credentials: set $KUBECONFIG, create ~/.kube/config, or run in a pod "
                       "with a service account")


def check(command: str, args: argparse.Namespace) -> None:
    """The checks that apply to one role, cheapest first."""
    if command in ("serve", "gateway", "prefill", "decode"):
        check_port_free(args.host, args.port)
        if getattr(args, "metrics_port", None):
            check_port_free(args.host, args.metrics_port, "--metrics-port")
    if command in ("generate", "serve", "gateway", "prefill", "decode"):
        check_model_path(args.model)
        if getattr(args, "speculative_model", None):
            check_model_path(args.speculative_model, "--speculative-model")
    if command in ("generate", "serve", "prefill", "decode"):
        check_device(args.device, args.kernel_backend)
    if command in ("serve", "gateway") and args.chat_template:
        from kvrelay.gateway.chat_render import load_template

        try:
            load_template(args.chat_template)
        except ValueError as e:
            raise StartupError(str(e)) from None
    if command == "operator":
        # Usage errors first: they hold whatever cluster the operator would reach.
        if args.namespace and not args.standalone:
            # kopf elects per namespace with namespaced KopfPeering objects, which the chart does not ship.
            raise StartupError("leader election is cluster-wide only; "
                               "with --namespace add --standalone (and run a single replica)")
        check_kubeconfig()
