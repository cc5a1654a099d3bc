#!/usr/bin/env bash
# The main job: train a small GPT in BF16 and then FP8 on the selected backend (the reference
# backend on a machine without an accelerator) and compare the loss curves. Sets itself up first.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
# the plot gets axes and a legend with matplotlib (the demo's optional extra); without it a
# built-in PNG writer draws the bare curves
python -c "import matplotlib" 2>/dev/null || python -m pip install -q matplotlib || true
te-core info
te-core demo "$@"
