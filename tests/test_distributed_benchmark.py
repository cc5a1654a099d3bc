"""benchmarks/bench_distributed.py's table: scaling over one GPU per precision, the targets
checked, a failed layout shown as a numbered error."""
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)
import _distributed_table  # noqa: E402
import bench_distributed  # noqa: E402

RUN = {
    "meta": {"gpu": "NVIDIA H200", "torch": "t", "date": "d"},
    "settings": {"hidden": 4096, "layers": 4, "heads": 32, "seq": 2048, "batch": 8, "steps": 10, "warmup": 3},
    "cells": {
        "1gpu bf16": {"tokens_per_s": 100_000.0}, "1gpu delayed": {"tokens_per_s": 150_000.0},
        "dp2 bf16": {"tokens_per_s": 195_000.0}, "dp2 delayed": {"tokens_per_s": 270_000.0},
        "tp2 bf16": {"tokens_per_s": 170_000.0}, "tp2 delayed": {"error": "RuntimeError: NCCL timeout\nwith | pipes"},
        "tp2-sp bf16": {"tokens_per_s": 150_000.0}, "tp2-sp delayed": {"tokens_per_s": 250_000.0},
    },
}


def test_table_shows_scaling_and_checks_the_targets():
    text = _distributed_table.render(RUN)
    assert "global batch 8 (16,384 tokens per step on every layout)" in text
    assert "| 1 GPU | 1 | 100.0k | 150.0k |" in text
    assert "| DP=2 | 2 | 195.0k (1.95x) | 270.0k (1.80x) |" in text
    assert "| TP=2 | 2 | 170.0k (1.70x) | error (1) |" in text
    assert "- DP=2 scaling ≥ 1.9x: bf16 1.95x met; delayed 1.80x **missed**" in text
    assert "- TP=2 per GPU ≥ 80% of 1 GPU: bf16 85% met; delayed not measured" in text
    assert "- TP=2 + SP per GPU ≥ 80% of 1 GPU: bf16 75% **missed**; delayed 83% met" in text
    assert "1. TP=2 delayed: `RuntimeError: NCCL timeout with / pipes`" in text


def test_every_layout_and_precision_of_the_script_has_a_row_and_column():
    assert [layout for layout, _, _ in _distributed_table.LAYOUTS] == list(bench_distributed.LAYOUTS)
    assert _distributed_table.PRECISIONS == bench_distributed.PRECISIONS
    args = bench_distributed.parse_args(["--smoke"])
    assert (args.hidden, args.heads, args.batch) == (64, 2, 4)
    assert args.layouts.split(",") == list(bench_distributed.LAYOUTS)
