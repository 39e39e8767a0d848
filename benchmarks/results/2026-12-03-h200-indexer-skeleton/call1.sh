set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
S=.scratch/s6
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
git log -1 --format=%h >> $OUT/gpu.txt 2>/dev/null
timeout 80 python3 $S/prep_only.py > $OUT/prep.log 2>&1; echo "prep rc=$?"; cat $OUT/prep.log
timeout 360 python3 $S/variants.py head,.scratch/s7/v_shared.py,.scratch/s7/v_shared2.py,$S/v_hot.py,$S/v_nobf16.py,$S/v_noprep.py,$S/v_wait.py "" 1024,32768,262144 > $OUT/v.log 2>&1; echo "v rc=$?"
timeout 120 python3 $S/variants.py $S/v_wait.py "slots=4,slots=16" 262144 > $OUT/vw.log 2>&1; echo "vw rc=$?"
cat $OUT/v.log $OUT/vw.log | grep -h "us\"" | python3 -c "
import sys, json, collections
d = collections.defaultdict(list)
for l in sys.stdin:
    r = json.loads(l); d[(r['keys'], r['mod'], r.get('slots'))].append(r['us'])
for k, v in sorted(d.items(), key=str): print(k, v)"
grep -h "rror\|bits" $OUT/v.log $OUT/vw.log | sort | uniq -c | head -40
