"""The demo launched by torchrun on 2 gloo CPU processes: data parallel, tensor parallel, and
tensor parallel with sequence parallelism (eager, and compiled with --compile) each train on the
single-process run's global batch and give its losses; only rank 0 prints and writes the
report. Bad layouts fail with a message."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch.distributed as dist

from te_core.demo import main

TIMEOUT_S = 240
ARGS = ["--size", "tiny", "--steps", "6", "--recipe", "delayed", "--no-progress", "--threads", "1"]
# BF16: the parallel runs differ from the single-process run only in how float32 sums are split
# and ordered (a replica's half batch, the gradient all-reduce, a shard's partial products), which
# moves the loss by far less than one bf16 rounding step (2^-8); a replica training without the
# others' gradients, or a shard missing part of its gradient, moves it by more within two steps.
BF16_LOSS = dict(rel=2e-3, abs=1e-5)
# FP8: each shard takes its own scale, so the runs round differently; the loss averages that
# rounding over every token, within bf16's tolerance.
FP8_LOSS = dict(rel=1.6e-2, abs=1e-5)

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    assert main(ARGS + ["--out", str(out)]) == 0
    return json.loads((out / "demo_run.json").read_text())


def torchrun(extra, out, nproc: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc -m te_core.demo ARGS extra`, killed (with its workers)
    and failed with a message if it runs longer than TIMEOUT_S."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "te_core.demo", *ARGS, "--out", str(out), *extra]
    env = dict(os.environ, TE_BACKEND="reference", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun {' '.join(extra)} did not finish within {TIMEOUT_S} s (a rank waiting in a "
                    f"collective?); stderr:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("extra, layout", [
    ([], "data parallel 2 x tensor parallel 1"),
    (["--tp", "2"], "data parallel 1 x tensor parallel 2"),
    (["--tp", "2", "--sequence-parallel"], "data parallel 1 x tensor parallel 2 with sequence parallelism"),
    (["--compile"], "data parallel 2 x tensor parallel 1"),
    (["--tp", "2", "--sequence-parallel", "--compile"], "data parallel 1 x tensor parallel 2 with sequence parallelism"),
], ids=["dp2", "tp2", "tp2-sp", "dp2-compiled", "tp2-sp-compiled"])
def test_parallel_run_tracks_the_single_process_run(tmp_path, single_run, extra, layout):
    done = torchrun(extra, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.count("te-core demo: backend reference") == 1  # rank 0 alone prints
    assert f"ranks  2 processes: {layout}" in out
    assert out.count("(2 ranks, ") == 2  # the tokens/s of both ranks together, and per rank
    record = json.loads((tmp_path / "demo_run.json").read_text())
    tp = 2 if "--tp" in extra else 1
    assert record["config"]["parallel"] == dict(world=2, dp=2 // tp, tp=tp, sequence_parallel="--sequence-parallel" in extra)
    for run, tol in (("bf16", BF16_LOSS), ("fp8", FP8_LOSS)):
        expected = single_run["runs"][run]["losses"]
        assert record["runs"][run]["losses"] == pytest.approx(expected, **tol), run
        assert record["runs"][run]["val_loss"] == pytest.approx(single_run["runs"][run]["val_loss"], **tol)
        assert record["runs"][run]["tokens_per_s"] > 0


def test_single_process_explains_how_to_launch(capsys):
    assert main(ARGS + ["--tp", "2"]) == 2
    assert "--tp 2 must divide the number of processes, 1 (launch with torchrun" in capsys.readouterr().err
    assert main(ARGS + ["--sequence-parallel"]) == 2
    assert "--sequence-parallel splits the sequence over the tensor-parallel ranks" in capsys.readouterr().err
    assert main(ARGS + ["--tp", "0"]) == 2
    assert "--tp must be at least 1, got 0" in capsys.readouterr().err


def test_layout_that_does_not_fit_the_model_is_rejected():
    from te_core.demo.model import SIZES
    from te_core.demo.parallel import check_layout

    tiny = SIZES["tiny"]  # 2 heads, batch 4, sequence 64
    assert "must divide the tiny model's 2 attention heads" in check_layout(4, 4, False, "tiny", tiny)
    assert "does not split over 8 data-parallel replicas" in check_layout(8, 1, False, "tiny", tiny)
    assert check_layout(2, 0, False, "tiny", tiny) == "--tp must be at least 1, got 0"
    assert check_layout(4, 2, True, "tiny", tiny) is None
