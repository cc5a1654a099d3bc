#!/usr/bin/env bash
# The test suite: unit tests, the conformance kit against the reference and template backends,
# and the backends' CPU tests (Triton kernels through the interpreter). Sets itself up first.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
# The `hf` test extra (transformers, accelerate) for tests/compat/test_hf_accelerate.py; where it
# cannot be installed (offline), that test skips and says why.
if ! python -c "import transformers, accelerate" 2>/dev/null; then
  PYTHONWARNINGS=ignore python -m pip install -q --retries 1 --no-build-isolation -e ".[hf]" 2>/dev/null ||
    echo "test: the hf extra is not installable here; tests/compat/test_hf_accelerate.py will be skipped" >&2
fi
# The `lightning` test extra (lightning-fabric) for tests/compat/test_lightning.py, the same way.
if ! python -c "import lightning_fabric" 2>/dev/null && ! python -c "import lightning.fabric" 2>/dev/null; then
  PYTHONWARNINGS=ignore python -m pip install -q --retries 1 --no-build-isolation -e ".[lightning]" 2>/dev/null ||
    echo "test: the lightning extra is not installable here; tests/compat/test_lightning.py will be skipped" >&2
fi
export TE_BACKEND=auto
paths=(tests)
for d in backends/cuda/tests plugins/template/tests; do
  [ -d "$d" ] && paths+=("$d")
done
python -m pytest -q "${paths[@]}" "$@"
# A run of their own: their conftests turn on Triton's CPU interpreter for the whole process,
# which must not reach the GPU tests above on a machine that has a GPU.
interpreted=()
for d in backends/triton/tests backends/musa/tests; do
  [ -d "$d" ] && interpreted+=("$d")
done
[ ${#interpreted[@]} -eq 0 ] || python -m pytest -q "${interpreted[@]}" "$@"
python -m pytest -q --pyargs te_core.testing --te-backend reference
python -m pytest -q --pyargs te_core.testing --te-backend template
