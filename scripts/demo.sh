#!/usr/bin/env bash
# The main job: train a small GPT in BF16 and then FP8 on the selected backend (the reference
# backend on a machine without an accelerator) and compare the loss curves. Sets itself up first.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
te-core info
te-core demo "$@"
