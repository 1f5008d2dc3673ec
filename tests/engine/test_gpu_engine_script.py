"""benchmarks/gpu_engine.py is the one device script of the GPU fast path: it must keep running, and
it must import kvrelay from a plain checkout on a machine where kvrelay is not installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_engine_cpu_smoke_runs_every_section(tmp_path):
    # As on the GPU machine: kvrelay not installed, and the packages its image lacks not importable.
    out = subprocess.run(
        [_bare_python(tmp_path), str(ROOT / "benchmarks" / "gpu_engine.py"), "--cpu-smoke"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = out.stdout.split("# summary", 1)[1]
    assert "parity stories260K greedy, cpu eager: 4/4 identical" in summary
    assert "parity stories260K greedy, cpu eager_async: 4/4 identical" in summary
    assert "decode step 4 seqs" in summary and "throughput kvrelay eager" in summary
    assert "x ~40 tokens, eager_async" in summary and "throughput kvrelay eager_async" in summary
    assert "throughput HF generate" in summary
    assert "decode_attention[splits=2]" in out.stdout and "int8_matmul" in out.stdout
    assert "speculative draft=target, batch 16" in summary and "identical to plain: True" in summary
    assert "hand-off 100 tokens over cuda-ipc" in summary and "identical: False" not in summary
    assert "TTFT beyond the compute" in summary
    assert "hand-off 100 tokens over cuda-ipc-reserve-first" in summary
    assert "under load (8 requests decoding" in summary and "over cuda-ipc: TTFT" in summary
    assert "decode: reserve <" in summary
    assert "hand-off 100 tokens, workers in their own processes" in summary
    assert "hand-offs the decode worker prefilled locally instead: 0" in summary
    assert "moe Mixtral-shape triton eager" in summary and "moe greedy torch vs triton eager: 4/4 identical" in summary
    assert "moe greedy fp8 triton eager vs fp8 torch: 4/4 identical" in summary
    assert "parallel stories260K greedy, cpu mp world size 1: 4/4 identical" in summary
    assert "parallel stories260K greedy, cpu mp_async world size 1, async scheduling: 4/4 identical" in summary
    assert "parallel step cpu 4 seqs x ~40 tokens, sampling on the worker" in summary
    assert summary.rstrip().endswith("# failed sections: none")


# kvrelay's dependencies that the bare GPU machine's image lacks (it has torch, triton, transformers,
# grpcio, protobuf, prometheus-client, msgpack, xxhash, httpx...): the device script must run without them.
DEVICE_MISSING = ("fastapi", "starlette", "uvicorn", "pydantic", "redis", "kopf", "kubernetes", "zmq",
                  "llguidance", "jsonschema", "openai", "mooncake")
BLOCKER = """import sys
class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU machine)", name=name)
sys.meta_path.insert(0, _Missing())
"""


def _bare_python(tmp_path: Path) -> str:
    """A venv that sees this one's packages but neither its editable kvrelay nor DEVICE_MISSING, as
    on a bare GPU machine: a .pth line only appends a folder to sys.path, so the editable finder's
    own .pth never runs; sitecustomize (run by every process of this python) blocks the rest."""
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=120)
    python = tmp_path / "venv" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    Path(site, "sitecustomize.py").write_text(BLOCKER.format(names=set(DEVICE_MISSING)))
    return str(python)


def test_package_map_imports_kvrelay_here_and_in_child_processes_without_pip(tmp_path):
    code = (
        "import multiprocessing, subprocess, sys\n"
        "def main():\n"
        "    try:\n"
        "        import kvrelay.engine\n"
        "        sys.exit('kvrelay still importable: the test cannot hide it')\n"
        "    except ImportError:\n"
        "        pass\n"
        f"    sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "    import package_map\n"
        "    package_map.map_kvrelay()\n"
        "    import kvrelay.engine.llm_engine, kvrelay.kernels.registry, kvrelay.models, kvrelay.gateway.structured\n"
        "    print(kvrelay.engine.llm_engine.__file__)\n"
        "    print(kvrelay.kernels.registry.__file__)\n"
        "    from kvrelay.engine.parallel.worker import decode, encode\n"
        "    # The parallel ranks are spawned: unpickling a kvrelay function imports kvrelay afresh there.\n"
        "    with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
        "        print(decode(pool.apply(encode, ('spawned',))))\n"
        "    child = 'import kvrelay.engine.llm_engine, kvrelay.v1.common_pb2; print(\"subprocess\")'\n"
        "    print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True).stdout.strip())\n"
        "if __name__ == '__main__':\n"
        "    main()\n"
    )
    script = tmp_path / "probe.py"
    script.write_text(code)
    out = subprocess.run([_bare_python(tmp_path), str(script)], capture_output=True, text=True, timeout=300,
                         check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    engine_file, kernels_file, spawned, child = out.stdout.split()
    assert Path(engine_file).resolve() == ROOT / "services" / "engine" / "llm_engine.py"
    assert Path(kernels_file).resolve() == ROOT / "kernels" / "ops" / "registry.py"
    assert (spawned, child) == ("spawned", "subprocess")


def test_workers_start_from_the_command_line_without_the_gateways_packages(tmp_path):
    """The device checks spawn `kvrelay prefill|decode` processes on the bare GPU machine: the CLI
    imports only the command asked for, so a worker needs no web stack, Redis or Kubernetes client."""
    import os
    import re
    import time

    python = _bare_python(tmp_path)
    tree = subprocess.run([python, str(ROOT / "benchmarks" / "package_map.py")], capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()
    env = dict(os.environ, PYTHONPATH=tree, PYTHONUNBUFFERED="1")
    for role in ("prefill", "decode"):
        proc = subprocess.Popen([python, "-m", "kvrelay.cli", role, "--host", "127.0.0.1", "--port", "0",
                                 "--num-kv-blocks", "32"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=tmp_path)
        lines = []
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line)
                if re.search(rf"kvrelay {role} listening on", line):
                    break
            assert any(f"kvrelay {role} listening on" in x for x in lines), "".join(lines)
        finally:
            proc.kill()
            proc.wait(30)
