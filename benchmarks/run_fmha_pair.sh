#!/usr/bin/env bash
# Route ``cuda`` of sparse_attention_fp8kv on the GPU machine, repo root, in one call:
#   OUT=dir bash benchmarks/run_fmha_pair.sh [smoke] [tests] [bench] [contracts]
# smoke: build the extension (timed) and compare one small case per layout with the emulation; tests: its GPU
# tests; contracts: the kernel contract tests; bench: bench_fmha_fp8kv.py --quick --diag-cuda with FlashMLA (.peer/FlashMLA,
# carried) beside it.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fmha_pair}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/gpu.txt" 2>&1
[ $# -gt 0 ] || set -- smoke tests bench
for what in "$@"; do
  case $what in
  smoke)
    timeout 240 python3 benchmarks/smoke_fmha_pair.py >"$OUT/smoke.log" 2>&1
    rc=$?; echo "smoke rc=$rc"; tail -20 "$OUT/smoke.log"
    [ $rc -eq 0 ] || exit $rc ;;
  tests)
    timeout 300 python3 -m pytest tests/gpu/test_sparse_attention_pair.py tests/gpu/test_sparse_attention_fp8kv.py \
      -q -p no:cacheprovider -rfE >"$OUT/pytest.log" 2>&1
    echo "pytest rc=$?"; tail -c 2500 "$OUT/pytest.log" ;;
  contracts)
    timeout 300 python3 -m pytest tests/gpu/test_kernel_contracts.py -k "sparse_attention or registered" -q -p no:cacheprovider -rfE \
      >"$OUT/contracts.log" 2>&1
    echo "contracts rc=$?"; tail -c 1500 "$OUT/contracts.log" ;;
  bench)
    timeout 400 python3 benchmarks/bench_fmha_fp8kv.py --out "$OUT" --quick --diag-cuda --peer .peer/FlashMLA >"$OUT/bench.log" 2>&1
    echo "bench rc=$?"; grep -E "^\[check|^\[peer|^\| V4|Error" "$OUT/bench.log" | grep -v "ws FP8 c" | cut -c1-400 ;;
  esac
done
