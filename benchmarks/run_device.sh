#!/usr/bin/env bash
# One device call: GPU info, the kernel benchmark (validates first), then the GPU test suite.
# Usage (on the GPU machine, repo root): OUT=dir bash benchmarks/run_device.sh [bench args...]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >"$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$OUT/gpu.txt" 2>&1
timeout "${BENCH_TIMEOUT:-320}" python3 benchmarks/bench_kernels.py --out "$OUT" "$@" >"$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -E "^\[|best|FAILED|Error|error" "$OUT/bench.log" | head -80
timeout 150 python3 benchmarks/diag_production_cuda.py >"$OUT/diag.log" 2>&1; echo "diag rc=$?"; cat "$OUT/diag.log" | tail -20
timeout "${TEST_TIMEOUT:-230}" python3 -m pytest tests/gpu -q -n 8 -p no:cacheprovider --timeout 200 \
  >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?"
tail -c 5000 "$OUT/pytest.log"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu --format=csv >>"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
