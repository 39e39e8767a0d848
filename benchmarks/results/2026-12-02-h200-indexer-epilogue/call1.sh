#!/usr/bin/env bash
# Call 1 of the fifth 2026-12-02 session (repo root, GPU machine; .scratch/ carries HEAD's and the register-A
# patch's indexer_ws.py): the ws indexer GPU tests, A/B against both, the read anchors, the packed-FP4 model test.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
OMP_NUM_THREADS=2 timeout 240 python3 -m pytest tests/gpu/test_kernels.py -q -n 6 -p no:cacheprovider -rfE \
  -k "index_scores_fp4 or half_tiles or query_preparation or one_head" > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; tail -3 $OUT/pytest.log
timeout 150 python3 benchmarks/ab_ws_revision.py indexer --old .scratch/old_head.py --out $OUT/vs_head > $OUT/ab_head.log 2>&1
echo "ab head rc=$?"; grep -c '"equal": true' $OUT/vs_head/ab_indexer.json; grep -c '"equal": false' $OUT/vs_head/ab_indexer.json
timeout 150 python3 benchmarks/ab_ws_revision.py indexer --old .scratch/old_rega.py --out $OUT/vs_rega > $OUT/ab_rega.log 2>&1
echo "ab rega rc=$?"; grep -c '"equal": true' $OUT/vs_rega/ab_indexer.json; grep -c '"equal": false' $OUT/vs_rega/ab_indexer.json
timeout 100 python3 benchmarks/diag_indexer_read.py --out $OUT > $OUT/read.log 2>&1; echo "read rc=$?"
OMP_NUM_THREADS=4 timeout 120 python3 -m pytest tests/gpu/test_production_cuda.py -q -p no:cacheprovider -rfE \
  -k "fp4" > $OUT/pytest_models.log 2>&1; echo "models rc=$?"; tail -2 $OUT/pytest_models.log
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu --format=csv >> $OUT/gpu.txt
grep -h "us$" $OUT/ab_head.log $OUT/ab_rega.log
grep -v '"block"' $OUT/read.log | cut -c1-200; grep '"best' $OUT/diag_indexer_read.json | head -0
python3 - <<'P'
import json, os
rows = json.load(open(os.path.join(os.environ["OUT"], "diag_indexer_read.json")))
for r in rows:
    print(r["what"], r.get("n_q"), r.get("keys"), r.get("block"), r.get("warps"), [round(x, 2) for x in r["us"]])
P
