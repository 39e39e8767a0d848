set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
S=.scratch/s6
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $OUT/gpu.txt
timeout 110 python3 benchmarks/results/2026-12-03-h200-indexer-skeleton/variants.py head,$S/v_wait.py "" 262144,1024 > $OUT/v.log 2>&1; echo "v rc=$?"
grep -h "us\"" $OUT/v.log | python3 -c "
import sys, json, collections
d = collections.defaultdict(list)
for l in sys.stdin:
    r = json.loads(l); d[(r['keys'], r['mod'])].append(r['us'])
for k, v in sorted(d.items(), key=str): print(k, v)"
OMP_NUM_THREADS=2 timeout 230 python3 -m pytest tests/gpu/test_kernels.py -q -n 8 -p no:cacheprovider --timeout 220 -rfE --durations=5 > $OUT/pytest.log 2>&1; echo "pytest kernels rc=$?"
tail -c 1200 $OUT/pytest.log
OMP_NUM_THREADS=4 timeout 150 python3 -m pytest tests/gpu -q -p no:cacheprovider -p no:xdist --ignore tests/gpu/test_kernels.py --timeout 140 -rfE --durations=5 > $OUT/pytest_models.log 2>&1; echo "pytest models rc=$?"
tail -c 1000 $OUT/pytest_models.log
timeout 90 python3 benchmarks/bench_layer_decode.py --out $OUT --steps 12 > $OUT/layer.log 2>&1; echo "layer rc=$?"
grep -v -i warn $OUT/layer.log | tail -14 | cut -c1-220
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu --format=csv >> $OUT/gpu.txt
