#!/usr/bin/env bash
# The test suite: unit tests, the conformance kit against the reference and template backends,
# and the backends' CPU tests (Triton kernels through the interpreter). Sets itself up first.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export TE_BACKEND=auto
paths=(tests)
for d in backends/triton/tests backends/cuda/tests backends/musa/tests plugins/template/tests; do
  [ -d "$d" ] && paths+=("$d")
done
python -m pytest -q "${paths[@]}" "$@"
python -m pytest -q --pyargs te_core.testing --te-backend reference
python -m pytest -q --pyargs te_core.testing --te-backend template
