set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
timeout 300 python3 benchmarks/bench_kernels.py --out $OUT --only norm > $OUT/bench.log 2>&1; echo "bench rc=$?"
grep -E "^\[|FAILED|Error" $OUT/bench.log | cut -c1-300 | head
python3 - <<'PY'
import json,os
r=json.load(open(os.environ["OUT"]+"/bench_kernels.json"))
rows=r["results"] if isinstance(r,dict) else r
for x in rows:
    if x.get("kernel","").startswith("rms"):
        print(x.get("shape"),"|",x.get("variant"),"|",x.get("config"),"|",round(x.get("us",-1),2),"|",round(x.get("frac_floor_measured") or 0,3),"|",x.get("validation"))
PY
OMP_NUM_THREADS=4 timeout 250 python3 -m pytest tests/gpu/test_kernels.py -q -p no:cacheprovider -k "rms_norm" -x --timeout 240 > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -5 $OUT/pytest.log
