#!/usr/bin/env bash
# One GPU-machine session: install, module benchmark (te vs bf16 torch vs torchao), kernel
# benchmark. Results land in $OUT (and benchmarks/results/ on that machine). torchao travels as a
# wheel in .whl/ (see PERFORMANCE.md); without it its rows are skipped.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/triton -e backends/cuda >/dev/null 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
    && export PYTHONPATH=/tmp/site
fi
OUT="${OUT:-benchmarks/results}"
timeout "${MODULES_TIMEOUT:-300}" python3 benchmarks/bench_modules.py > "$OUT/modules.txt" 2>&1
timeout "${KERNELS_TIMEOUT:-100}" python3 benchmarks/bench_kernels.py --quick --no-compile > "$OUT/kernels.txt" 2>&1
tail -n 12 "$OUT/modules.txt"
tail -n 30 "$OUT/kernels.txt"
# the targets table (docs/performance.md's generated section), from this run's JSON
kernels_json=$(ls -t "$OUT"/kernels-*.json 2>/dev/null | head -n 1)
if [ -f "$OUT/modules.json" ] && [ -n "$kernels_json" ]; then
  python3 benchmarks/report.py "$OUT/modules.json" "$kernels_json" --print
fi
