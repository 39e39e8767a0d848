export PYTHONPATH=$PWD OMP_NUM_THREADS=16
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
mkdir -p $OUT/dump $OUT/cache
timeout 380 python3 benchmarks/bench_dump_layers.py --work /tmp/db --out $OUT/dump --layers 8 --prompt 16 --decode 1 --orders stream --device cuda > $OUT/dump/log.txt 2>&1; echo "dump rc=$?"; tail -30 $OUT/dump/log.txt
timeout 190 python3 benchmarks/bench_1m_cache_memory.py --out $OUT/cache > $OUT/cache/log.txt 2>&1; echo "cache rc=$?"; tail -30 $OUT/cache/log.txt
