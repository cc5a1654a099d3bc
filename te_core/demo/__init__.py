"""The te-core demo: a small GPT trained in BF16 and FP8 on text that needs no download.

Entry point: `te_core.demo.main(argv)` (the CLI's `te-core demo`, or `python -m te_core.demo`).
Under torchrun it trains with data and tensor parallelism (`--tp`, `--sequence-parallel`; see
te_core.demo.parallel).
"""

from .main import main

__all__ = ["main"]
