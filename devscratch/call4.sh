set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
timeout 200 python3 benchmarks/bench_kernels.py --out $OUT --only norm > $OUT/bench.log 2>&1; echo "bench rc=$?"
grep -E "FAILED|Error" $OUT/bench.log | head
python3 - <<'PY'
import json,os
r=json.load(open(os.environ["OUT"]+"/bench_kernels.json"))
for x in r["results"]:
    if x.get("kernel","").startswith("rms") and (not x.get("config") or x["config"].get("per_sm") is not None and x["config"].get("rows")==1) :
        print(x.get("shape"),"|",x.get("variant"),"|",x.get("config"),"|",round(x.get("us",-1),2),"|",round(x.get("frac_floor_measured") or 0,3),"|",x.get("validation"), x.get("check") and x["check"].get("codes_bit_exact_given_y"))
print(r["ceilings"])
PY
OMP_NUM_THREADS=2 timeout 380 python3 -m pytest tests/gpu/test_kernels.py -q -n 8 -p no:cacheprovider --timeout 360 -rfE > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -c 1500 $OUT/pytest.log
