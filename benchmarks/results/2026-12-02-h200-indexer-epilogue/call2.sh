#!/usr/bin/env bash
# Call 2 (repo root, GPU machine; kernel code of c1f5cf0): the ws kernel beside the read anchors, bench_kernels
# --only index --quick, the layer decode step, Nsight Compute's stall sampling of one 1M-context launch.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
timeout 150 python3 benchmarks/diag_indexer_read.py --out $OUT > $OUT/read.log 2>&1; echo "read rc=$?"
timeout 240 python3 benchmarks/bench_kernels.py --out $OUT --only index --quick > $OUT/bench.log 2>&1; echo "bench rc=$?"
timeout 150 python3 benchmarks/bench_layer_decode.py --out $OUT --steps 12 > $OUT/layer.log 2>&1; echo "layer rc=$?"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 120 $NCU --clock-control none --section WarpStateStats --section SourceCounters -k regex:_index_ws_kernel \
  -s 2 -c 1 -o /tmp/idx python3 benchmarks/launch_ws_kernel.py indexer > $OUT/ncu.log 2>&1; echo "ncu rc=$?"
$NCU --import /tmp/idx.ncu-rep --page details > $OUT/ncu_details.txt 2>&1
$NCU --import /tmp/idx.ncu-rep --page raw --csv 2>/dev/null | python3 -c "
import csv, sys
rows = list(csv.reader(sys.stdin))
for name, unit, value in zip(rows[0], rows[1], rows[2]):
    if 'stall' in name or 'issue' in name or 'cycles' in name or 'duration' in name:
        print(name, unit, value)" > $OUT/ncu_raw_stalls.txt
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu --format=csv >> $OUT/gpu.txt
python3 - <<'P'
import json, os
for r in json.load(open(os.path.join(os.environ["OUT"], "diag_indexer_read.json"))):
    if r.get("block") is None or "best" in r["what"]:
        print(r["what"], r.get("n_q"), r.get("keys"), r.get("block"), r.get("warps"), [round(x, 2) for x in r["us"]])
P
grep -E "^\[|index" $OUT/bench.log | cut -c1-220 | tail -20
grep -v -i warn $OUT/layer.log | tail -12 | cut -c1-220
grep -i "pcsamp_warps_issue_stalled\|warps_issue_stalled" $OUT/ncu_raw_stalls.txt | sort -t' ' -k3 -n -r | head -14
grep -E "Duration|Issued Ipc|Warp Cycles Per Issued|Eligible|Active Warps" $OUT/ncu_details.txt | head -10
