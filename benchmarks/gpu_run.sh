#!/usr/bin/env bash
# Runs the benchmark suite on a GPU machine, from the repository root:
#   bash benchmarks/gpu_run.sh [modules] [kernels] [sweep] [graphed] [captured] [conformance] [hf] [host] [module-tests]
# (no argument: modules, kernels, sweep, conformance; graphed re-measures the sweep's layer and tiny
# rows under CUDA graphs (mode reduce-overhead) into the same sweep.json; captured measures the tiny,
# linear and layer rows captured whole with te.make_graphed_callables, beside their eager cells;
# hf trains a converted Hugging Face Llama and needs transformers;
# host counts a te.Linear step's torch ops, launches and Python calls;
# module-tests runs the module test suite on the cuda backend and keeps its summary; MODULE_TESTS_FILES
# names some of its files; the test parts split their files into TEST_JOBS (4) processes side by side)
# Installs te-core, te_triton and te-backend-cuda (editable, no dependencies: torch and triton
# come with the machine); torchao, an optional peer, is installed from a wheel in .whl/ when one
# is there (copy it into .whl/ beforehand; without it the torchao cells say why they are empty).
# Results land in RESULTS/<gpu>/ (RESULTS: $OUT/results when $OUT is set, else benchmarks/results),
# with the generated tables in RESULTS/<gpu>/table.md. Each part has its own time limit
# (MODULES_TIMEOUT, KERNELS_TIMEOUT, SWEEP_TIMEOUT, GRAPHED_TIMEOUT, CAPTURED_TIMEOUT, CONFORMANCE_TIMEOUT, HF_TIMEOUT,
# HOST_TIMEOUT, MODULE_TESTS_TIMEOUT, and CUDA_TESTS_TIMEOUT for the backend's own tests in the
# conformance part, in seconds). A test run cut by its limit says so in its output file: pytest
# killed mid-run prints no summary, and a file without one would read as a crash.
set -u
export PYTHONUNBUFFERED=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(modules kernels sweep conformance)
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/triton -e backends/cuda >/dev/null 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
    && export PYTHONPATH=/tmp/site
fi
limited() {  # limited SECONDS CMD...: CMD under timeout, with a closing line when the limit cut it
  local seconds=$1 rc
  shift
  timeout "$seconds" "$@"
  rc=$?
  [ $rc -eq 124 ] && echo "TIMED OUT: stopped after ${seconds} s (raise the part's *_TIMEOUT); the results above are partial"
  return $rc
}
RESULTS="${OUT:+$OUT/results}"
RESULTS="${RESULTS:-benchmarks/results}"
mkdir -p "$RESULTS"
gpu=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import _results; print(_results.gpu_slug(_results.device_name()))")
mkdir -p "$RESULTS/$gpu"
for part in "${parts[@]}"; do
  echo "=== $part"
  case "$part" in
    modules) timeout "${MODULES_TIMEOUT:-300}" python3 benchmarks/bench_modules.py --results "$RESULTS" 2>&1 | tail -n 12 ;;
    kernels) timeout "${KERNELS_TIMEOUT:-150}" python3 benchmarks/bench_kernels.py --quick --no-compile --results "$RESULTS" 2>&1 | tail -n 30 ;;
    sweep) timeout "${SWEEP_TIMEOUT:-480}" python3 benchmarks/bench_sweep.py --results "$RESULTS" 2>&1 | tail -n 60 ;;
    graphed)  # merged into the sweep.json there, or the committed one when RESULTS has none yet
      [ -f "$RESULTS/$gpu/sweep.json" ] || cp "benchmarks/results/$gpu/sweep.json" "$RESULTS/$gpu/" 2>/dev/null
      timeout "${GRAPHED_TIMEOUT:-420}" python3 benchmarks/bench_sweep.py --only layer,tiny --mode reduce-overhead \
        --merge --budget-s 360 --results "$RESULTS" 2>&1 | tail -n 40 ;;
    captured)  # likewise merged
      [ -f "$RESULTS/$gpu/sweep.json" ] || cp "benchmarks/results/$gpu/sweep.json" "$RESULTS/$gpu/" 2>/dev/null
      timeout "${CAPTURED_TIMEOUT:-300}" python3 benchmarks/bench_sweep.py --only tiny,linear,layer --mode captured \
        --merge --budget-s 240 --results "$RESULTS" 2>&1 | tail -n 40 ;;
    conformance)
      { echo "# $(python3 -c 'import torch, triton; print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)'), $(date -u +%F)"
        echo "## backends/cuda/tests in ${TEST_JOBS:-4} shares side by side (benchmarks/tools/sharded_pytest.py)"
        python3 benchmarks/tools/sharded_pytest.py --jobs "${TEST_JOBS:-4}" --timeout "${CUDA_TESTS_TIMEOUT:-420}" \
          backends/cuda/tests/test_*.py -- -rs 2>&1 | tail -n 60
        echo "## python3 -m pytest -q -rs --pyargs te_core.testing --te-backend cuda"
        limited "${CONFORMANCE_TIMEOUT:-300}" python3 -m pytest -q -rs --pyargs te_core.testing --te-backend cuda 2>&1 | tail -n 40
      } > "$RESULTS/$gpu/conformance-cuda.txt"
      tail -n 25 "$RESULTS/$gpu/conformance-cuda.txt" ;;
    hf) timeout "${HF_TIMEOUT:-330}" python3 benchmarks/bench_hf.py --results "$RESULTS" 2>&1 | tail -n 20 ;;
    host) timeout "${HOST_TIMEOUT:-180}" python3 benchmarks/bench_host.py --results "$RESULTS" 2>&1 | tail -n 12 ;;
    module-tests)
      { echo "# $(python3 -c 'import torch, triton; print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)'), $(date -u +%F)"
        echo "## pytest -k cuda over ${MODULE_TESTS_FILES:-tests/modules/test_*.py}, in ${TEST_JOBS:-4} shares side by side"
        # shares run as parallel processes (the suite is bound by the host, not the GPU), so it fits
        # one command; MODULE_TESTS_FILES narrows it to some files
        python3 benchmarks/tools/sharded_pytest.py --jobs "${TEST_JOBS:-4}" --timeout "${MODULE_TESTS_TIMEOUT:-480}" \
          ${MODULE_TESTS_FILES:-tests/modules/test_*.py} -- -rfs --tb=line -p no:logging -k cuda 2>&1 | tail -n 80
      } > "$RESULTS/$gpu/modules-cuda.txt"
      tail -n 25 "$RESULTS/$gpu/modules-cuda.txt" ;;
    *) echo "unknown part '$part': choose from modules, kernels, sweep, graphed, captured, conformance, hf, host, module-tests" >&2; exit 2 ;;
  esac
done
python3 benchmarks/report.py "$RESULTS/$gpu" --print
