#!/usr/bin/env bash
# The GPU checks of issues 20 and 21, for a bare GPU machine (torch, triton, transformers, grpcio,
# protobuf, prometheus-client, xxhash; kvrelay not installed), in two calls of under 10 minutes:
#
#   bash scripts/device_check.sh 1   # the CUDA-only tests, then parity, step, throughput, fp8, kernels
#   bash scripts/device_check.sh 2   # spec, handoff (CUDA IPC), moe, parallel
#
# Logs and figures go to $OUT (default /tmp/kvrelay-device): pytest.log, engine.log, gpu_engine.json.
# tests/engine/test_gpu_engine_script.py rehearses the engine part on CPU without the packages the
# GPU image lacks.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvrelay-device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PYTHONPATH=$(python3 benchmarks/package_map.py) || exit 1  # kvrelay from this checkout, child processes too
export PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"

case "${1:-1}" in
1)
    # The tests that skip without CUDA (graphs, async scheduling, memory sizing, FlashAttention prefill,
    # piecewise graphs, the CUDA IPC plane end to end).
    timeout 170 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_model_runner.py \
        tests/engine/test_async_scheduling.py::test_async_scheduling_on_cuda_graphs_gives_the_synchronous_outputs \
        "tests/engine/test_async_scheduling.py::test_logprobs_and_prompt_logprobs_overlap_and_match_the_synchronous_ones[cuda]" \
        tests/engine/test_flash_prefill.py tests/engine/test_piecewise_graphs.py tests/workers/test_pd_cuda_ipc.py \
        2>&1 | tee "$OUT/pytest.log"
    timeout 400 python3 benchmarks/gpu_engine.py --no-hf --only parity,step,throughput,fp8,kernels 2>&1 \
        | tee "$OUT/engine.log"
    ;;
2)
    timeout 540 python3 benchmarks/gpu_engine.py --no-hf --only spec,handoff,moe,parallel 2>&1 | tee "$OUT/engine.log"
    ;;
*)
    echo "usage: bash scripts/device_check.sh 1|2" >&2
    exit 2
    ;;
esac
