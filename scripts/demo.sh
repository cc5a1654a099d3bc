#!/usr/bin/env bash
# The main job: train a small GPT in BF16 and then FP8 on the selected backend (the reference
# backend on a machine without an accelerator) and compare the loss curves and the speed.
# Sets itself up first. Options go to `te-core demo` (--help lists them; --verbose adds the
# backend report and op table of `te-core info`).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
te-core demo "$@"
