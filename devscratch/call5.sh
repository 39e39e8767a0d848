set -u
export PYTHONUNBUFFERED=1
OMP_NUM_THREADS=4 timeout 220 python3 -m pytest tests/gpu -q -p no:cacheprovider -p no:xdist --ignore tests/gpu/test_kernels.py --timeout 200 -rfE > $OUT/pytest_models.log 2>&1; echo "pytest models rc=$?"; tail -c 600 $OUT/pytest_models.log
timeout 200 python3 benchmarks/bench_layer_decode.py --out $OUT --steps 12 > $OUT/layer.log 2>&1; echo "layer rc=$?"; grep -v -i warn $OUT/layer.log | head -30
