#!/usr/bin/env bash
# The GPU checks of issues 20 and 21, for a bare GPU machine (torch, triton, transformers, grpcio,
# protobuf, prometheus-client, xxhash; kvrelay not installed), in two calls of under 10 minutes:
#
# First, here: `bash scripts/device_wheels.sh`, and name .whl in the device call's carry.
#
#   bash scripts/device_check.sh 1   # the engine's CUDA-only tests, then parity, step, throughput, fp8, kernels
#   bash scripts/device_check.sh 2   # the CUDA IPC plane's tests, then handoff (in one process and as two
#                                    # worker processes: CUDA IPC), spec, parallel_step, moe, parallel, penalties
#
# Logs and figures go to $OUT (default /tmp/kvrelay-device): pytest.log, engine.log, gpu_engine.json.
# tests/engine/test_gpu_engine_script.py rehearses the engine part on CPU without the packages the
# GPU image lacks.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvrelay-device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (scripts/device_wheels.sh): pytest-asyncio
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
else
    echo "no .whl/: the async tests need pytest-asyncio (bash scripts/device_wheels.sh here, carry .whl)" >&2
fi
PYTHONPATH=$(python3 benchmarks/package_map.py) || exit 1  # kvrelay from this checkout, child processes too
export PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"

case "${1:-1}" in
1)
    # The engine's tests that skip without CUDA (graphs, async scheduling with logprobs, memory sizing,
    # FlashAttention prefill, piecewise graphs with MoE).
    timeout 170 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_model_runner.py \
        tests/engine/test_async_scheduling.py::test_async_scheduling_on_cuda_graphs_gives_the_synchronous_outputs \
        "tests/engine/test_async_scheduling.py::test_logprobs_and_prompt_logprobs_overlap_and_match_the_synchronous_ones[cuda]" \
        tests/engine/test_flash_prefill.py tests/engine/test_piecewise_graphs.py \
        2>&1 | tee "$OUT/pytest.log"
    timeout 400 python3 benchmarks/gpu_engine.py --no-hf --only parity,step,throughput,fp8,kernels 2>&1 \
        | tee "$OUT/engine.log"
    ;;
2)
    # The CUDA IPC plane end to end (two worker processes for the kill test), and the copy stream.
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/workers/test_pd_cuda_ipc.py 2>&1 \
        | tee "$OUT/pytest.log"
    timeout 420 python3 benchmarks/gpu_engine.py --no-hf --only spec,handoff,handoff_procs,parallel_step,moe,parallel,penalties 2>&1 \
        | tee "$OUT/engine.log"
    ;;
*)
    echo "usage: bash scripts/device_check.sh 1|2" >&2
    exit 2
    ;;
esac
