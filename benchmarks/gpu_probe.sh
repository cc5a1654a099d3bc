#!/usr/bin/env bash
# Diagnostics for one GPU-machine call: install, sample clocks/power in the background, then the
# scripts named as arguments (each "script args..." quoted); raw output lands in $OUT.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/triton -e backends/cuda >/dev/null 2>&1
OUT="${OUT:-benchmarks/results}"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 250 \
  > "$OUT/smi.csv" 2>&1 &
SMI=$!
for cmd in "$@"; do
  echo "=== $cmd" | tee -a "$OUT/probe.txt"
  (cd benchmarks && timeout 240 python3 $cmd) 2>&1 | tee -a "$OUT/probe.txt" | tail -n 40
done
kill $SMI
python3 - "$OUT/smi.csv" <<'PY'
import sys
rows = [l.split(", ") for l in open(sys.argv[1]) if l.count(",") >= 4]
sm = [int(r[1].split()[0]) for r in rows if r[1].split()[0].isdigit()]
pw = [float(r[3].split()[0]) for r in rows if r[3].split()[0].replace(".", "").isdigit()]
if sm:
    print(f"SM clock MHz: min {min(sm)} median {sorted(sm)[len(sm)//2]} max {max(sm)}; power W: max {max(pw):.0f} "
          f"median {sorted(pw)[len(pw)//2]:.0f} ({len(sm)} samples)")
PY
