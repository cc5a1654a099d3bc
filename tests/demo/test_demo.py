"""The demo end to end with a tiny setting, its arguments, and its report helpers."""

import json
import math
import time

import pytest
import torch

from te_core.backend import registry
from te_core.demo import main
from te_core.demo.data import BatchSampler, load_corpus, split, stdlib_dir, stdlib_sources
from te_core.demo.figure import BF16_COLOR, FP8_COLOR, GAP_COLOR
from te_core.demo.main import _fp8_emulated, default_size
from te_core.demo.model import SIZES
from te_core.demo import train as train_module
from te_core.demo.report import final_gap, side_by_side, speed
from te_core.demo.train import SETTLE, RunConfig, train

from .pngdecode import count, decode


def test_demo_tiny_run_writes_sensible_json_and_png(tmp_path, capsys):
    threads_before = torch.get_num_threads()
    rc = main(["--size", "tiny", "--steps", "24", "--recipe", "current", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    assert torch.get_num_threads() == threads_before  # the demo's thread choice does not leak
    record = json.loads((tmp_path / "demo_run.json").read_text())
    assert record["backend"] == "reference" and record["recipe"] == "current" and record["device"] == "cpu"
    assert record["config"]["size"] == "tiny" and record["config"]["steps"] == 24
    assert 1 <= record["config"]["threads"] <= threads_before
    assert record["config"]["pinned_cpu"] is None  # a CPU run keeps all its cores
    bf16, fp8 = record["runs"]["bf16"]["losses"], record["runs"]["fp8"]["losses"]
    assert len(bf16) == len(fp8) == 24
    assert abs(bf16[0] - math.log(256)) < 0.5  # starts near a uniform guess over bytes
    assert sum(bf16[-4:]) / 4 < bf16[0] - 1.0 and sum(fp8[-4:]) / 4 < fp8[0] - 1.0  # both learn
    assert bf16 != fp8  # the FP8 run really quantized
    assert abs(record["final_gap"]["gap"]) < 0.25
    rates = record["speed"]
    assert rates["bf16_tokens_per_s"] == record["runs"]["bf16"]["tokens_per_s"] > 0
    assert rates["fp8_tokens_per_s"] == record["runs"]["fp8"]["tokens_per_s"] > 0
    assert rates["fp8_over_bf16"] == pytest.approx(rates["fp8_tokens_per_s"] / rates["bf16_tokens_per_s"])
    tokens_per_step = SIZES["tiny"].tokens_per_step
    for name in ("bf16", "fp8"):
        run = record["runs"][name]
        assert 0 < run["steady_seconds"] < run["seconds"]  # the first steps are left out
        assert run["steady_tokens_per_s"] == pytest.approx(tokens_per_step * (24 - SETTLE) / run["steady_seconds"])
        assert rates[f"{name}_steady_tokens_per_s"] == run["steady_tokens_per_s"]
    assert rates["fp8_over_bf16_steady"] == pytest.approx(
        rates["fp8_steady_tokens_per_s"] / rates["bf16_steady_tokens_per_s"])
    _, _, rows = decode((tmp_path / "loss_curves.png").read_bytes())
    assert all(count(rows, color) > 20 for color in (BF16_COLOR, FP8_COLOR, GAP_COLOR))
    out = capsys.readouterr().out
    assert out.startswith("te-core demo: backend reference on cpu, ")
    assert "model  tiny:" in out and "recipe current; 24 steps each" in out
    assert "bf16 loss" in out and "fp8 loss" in out and "fp8/bf16" in out
    steady = f"{record['runs']['fp8']['steady_tokens_per_s']:,.0f} after the first 3 steps)"
    assert f"fp8: {record['runs']['fp8']['seconds']:.1f}s, " in out and steady in out
    # the steady state leads the speed line; the whole run follows
    line = next(row for row in out.splitlines() if row.startswith("speed"))
    assert line == (f"speed after the first 3 steps (compilation, warm-up): bf16 "
                    f"{rates['bf16_steady_tokens_per_s']:,.0f} tokens/s, fp8 {rates['fp8_steady_tokens_per_s']:,.0f} "
                    f"tokens/s, fp8/bf16 {rates['fp8_over_bf16_steady']:.2f}x; over the whole run: bf16 "
                    f"{rates['bf16_tokens_per_s']:,.0f} tokens/s, fp8 {rates['fp8_tokens_per_s']:,.0f} tokens/s, "
                    f"fp8/bf16 {rates['fp8_over_bf16']:.2f}x")
    assert "runs on" not in out and "Selected:" not in out  # the op table only with --verbose
    # on the reference backend FP8 costs work instead of saving it: the header says so
    assert "  note   the reference backend emulates the FP8 GEMMs" in out


def test_verbose_adds_the_backend_report_and_the_corpus(tmp_path, capsys):
    assert main(["--size", "tiny", "--steps", "2", "--out", str(tmp_path), "--no-progress", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "Selected: reference" in out and "runs on" in out and "data   " in out
    # two steps leave no steady state: reported as n/a, stored as null
    assert out.count("tokens/s (n/a after the first 3 steps)") == 2
    assert "fp8/bf16" in out and "(no steady state: a run of 3 steps or fewer)\n" in out
    assert "after the first 3 steps (compilation" not in out
    record = json.loads((tmp_path / "demo_run.json").read_text())
    assert record["runs"]["bf16"]["tokens_per_s"] > 0 and record["speed"]["fp8_over_bf16"] > 0
    for name in ("bf16", "fp8"):
        assert record["runs"][name]["steady_seconds"] is None and record["runs"][name]["steady_tokens_per_s"] is None
        assert record["speed"][f"{name}_steady_tokens_per_s"] is None
    assert record["speed"]["fp8_over_bf16_steady"] is None


@pytest.mark.parametrize("backend, overrides, emulated", [
    ("reference", "", True), ("template", "", False), ("template", "gemm_fp8=reference", True)])
def test_fp8_is_called_emulated_where_the_reference_runs_the_fp8_gemms(monkeypatch, backend, overrides, emulated):
    pytest.importorskip("te_backend_template")  # a backend that declares gemm_fp8 itself
    monkeypatch.setenv("TE_BACKEND", backend)
    monkeypatch.setenv("TE_BACKEND_OVERRIDES", overrides)
    registry.REGISTRY.reset()
    try:
        assert _fp8_emulated() is emulated
    finally:
        monkeypatch.undo()
        registry.REGISTRY.reset()


def test_demo_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["--recipe", "fp4"])
    assert "invalid choice: 'fp4'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--size", "huge"])
    assert "invalid choice: 'huge'" in capsys.readouterr().err
    for argv, message in (
        (["--steps", "1"], "--steps must be at least 2, got 1"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),
        (["--lr", "-0.1"], "--lr must be a positive finite number, got -0.1"),
        (["--lr", "inf"], "--lr must be a positive finite number, got inf"),
        (["--out", __file__], "is a file; give a directory you can write to"),
        (["--out", "/proc/te-core-demo/out"], "--out '/proc/te-core-demo/out' cannot be made"),
        (["--backend", "no-such-backend", "--steps", "2"], "--backend no-such-backend"),
        (["--device", "no-such-device", "--steps", "2"], "--device no-such-device: not usable here"),
        (["--device", "meta", "--steps", "2"], "--device meta: meta tensors hold no data to train on"),
        (["--out", "/proc"], "--out '/proc' is not writable"),
        (["--pin-host-thread", "--steps", "2"], "--pin-host-thread is for training on an accelerator"),
        (["--capture", "--compile"], "--capture and --compile are two ways"),
        (["--capture", "--steps", "2"], "--capture needs an accelerator whose torch module captures graphs; cpu"),
    ):
        assert main(argv) == 2
        assert message in capsys.readouterr().err


def test_default_size_is_small_on_a_cpu_and_larger_on_an_accelerator():
    assert default_size(torch.device("cpu")) == "small"
    accelerator = SIZES[default_size(torch.device("meta"))]  # any device type but "cpu"
    small = SIZES["small"]
    assert accelerator.hidden_size >= 2048 and accelerator.tokens_per_step >= 8 * small.tokens_per_step
    for cfg in SIZES.values():  # every recipe, MXFP8's 32-element blocks included, can quantize every GEMM
        assert cfg.hidden_size % 32 == 0 and (cfg.hidden_size // cfg.num_heads) % 32 == 0
        assert cfg.tokens_per_step % 32 == 0


def test_train_times_the_device_work_and_returns_every_loss():
    tokens, _ = load_corpus(200_000)
    train_tokens, val_tokens = split(tokens)
    calls = []
    cfg = RunConfig(model=SIZES["tiny"], steps=3, eval_batches=1)
    run = train("bf16", cfg, train_tokens, val_tokens, torch.device("cpu"), progress=False,
                synchronize=lambda: calls.append(1))  # fmt: skip
    assert len(calls) == 2  # before the clock starts and before it stops
    assert len(run.losses) == 3 and all(isinstance(v, float) and math.isfinite(v) for v in run.losses)
    assert run.tokens_per_s == pytest.approx(3 * cfg.model.tokens_per_step / run.seconds)
    assert math.isfinite(run.val_loss)
    assert SETTLE == 3 and math.isnan(run.steady_seconds) and math.isnan(run.steady_tokens_per_s)  # no step left


def test_steady_state_timing_starts_after_the_settling_steps(monkeypatch):
    """The steady-state clock starts at a synchronization after the first SETTLE loss steps and
    stops with the whole-run clock."""
    steps_done, loss_of = [], train_module.loss_of

    def counted_loss(*args):
        steps_done.append(1)
        return loss_of(*args)

    monkeypatch.setattr(train_module, "loss_of", counted_loss)
    tokens, _ = load_corpus(200_000)
    train_tokens, val_tokens = split(tokens)
    syncs = []  # (loss steps run so far, time) at each synchronization
    cfg = RunConfig(model=SIZES["tiny"], steps=SETTLE + 3, eval_batches=0)
    run = train("bf16", cfg, train_tokens, val_tokens, torch.device("cpu"), progress=False,
                synchronize=lambda: syncs.append((len(steps_done), time.perf_counter())))  # fmt: skip
    assert [n for n, _ in syncs] == [0, SETTLE, cfg.steps]
    (_, t_start), (_, t_settled), (_, t_end) = syncs
    assert 0 < run.steady_seconds < run.seconds
    # each clock reading follows its synchronization at once
    assert run.seconds == pytest.approx(t_end - t_start, abs=0.05)
    assert run.steady_seconds == pytest.approx(t_end - t_settled, abs=0.05)
    assert run.steady_tokens_per_s == pytest.approx(3 * cfg.model.tokens_per_step / run.steady_seconds)
    assert run.as_dict()["steady_tokens_per_s"] == run.steady_tokens_per_s
    assert run.as_dict()["steady_seconds"] == run.steady_seconds


def test_corpus_is_stdlib_source_and_batches_are_reproducible():
    files = stdlib_sources(stdlib_dir())
    assert any(f.endswith("os.py") for f in files)
    tokens, n_files = load_corpus(200_000)
    assert tokens.dtype == torch.uint8 and tokens.numel() == 200_000 and n_files >= 1
    a = BatchSampler(tokens, 3, 16, seed=5).next(torch.device("cpu"))
    b = BatchSampler(tokens, 3, 16, seed=5).next(torch.device("cpu"))
    assert torch.equal(a[0], b[0]) and torch.equal(a[0][:, 1:], a[1][:, :-1])


def test_report_helpers():
    gap = final_gap([4.0] * 9 + [2.0], [4.0] * 9 + [2.5])
    assert gap["steps_averaged"] == 1 and gap["gap"] == pytest.approx(0.5)
    assert gap["relative_gap"] == pytest.approx(0.25)
    table = side_by_side([5.0, 4.0, 3.0], [5.0, 4.1, 3.2], rows=10)  # rows capped at the step count
    assert table.count("\n") == 3 and "+0.2000" in table  # 3 steps: the EMA is the raw curve
    rates = speed(2000.0, 3000.0, 4000.0, 5000.0)
    assert rates == dict(bf16_tokens_per_s=2000.0, fp8_tokens_per_s=3000.0, fp8_over_bf16=1.5,
                         bf16_steady_tokens_per_s=4000.0, fp8_steady_tokens_per_s=5000.0, fp8_over_bf16_steady=1.25)
    assert math.isnan(speed(0.0, 10.0, 1.0, 1.0)["fp8_over_bf16"])
    short = speed(2000.0, 3000.0, math.nan, math.nan)  # runs too short for a steady state
    assert short["fp8_over_bf16"] == 1.5 and math.isnan(short["fp8_over_bf16_steady"])


def test_compiled_training_step_gives_the_eager_losses():
    """--compile runs the same loss step through torch.compile (here dynamo with the aot_eager
    backend, fast on a CPU): the FP8 run's losses equal the eager run's."""
    from te_core.demo.main import compile_options
    from te_core.demo.train import make_recipe

    assert compile_options(False, torch.device("cpu")) is None
    assert compile_options(True, torch.device("cpu")) == {}
    assert compile_options(True, torch.device("meta")) == {"mode": "reduce-overhead"}
    assert compile_options(True, torch.device("meta"), processes=2) == {}
    tokens, _ = load_corpus(200_000)
    train_tokens, val_tokens = split(tokens)
    cfg = RunConfig(model=SIZES["tiny"], steps=3, eval_batches=1)
    runs = [train("fp8", cfg, train_tokens, val_tokens, torch.device("cpu"), make_recipe("delayed"), progress=False,
                  compile_options=options)
            for options in (None, {"backend": "aot_eager"})]
    assert runs[0].losses == pytest.approx(runs[1].losses, rel=1e-5, abs=1e-6)
    assert runs[0].val_loss == pytest.approx(runs[1].val_loss, rel=1e-5, abs=1e-6)


def _emulated_capture(callables, sample_args, num_warmup_iters=3, allow_unused_input=False):
    """torch.<device>.make_graphed_callables stand-in: its warm-up steps, then each callable kept as
    it is, so that a "replay" runs the layer through te_core's graphed forward."""
    for module, args in zip(callables, sample_args):
        inputs = [a for a in args if a.requires_grad] + [p for p in module.parameters() if p.requires_grad]
        for _ in range(num_warmup_iters):
            out = module(*args)
            torch.autograd.grad(out, inputs, torch.randn_like(out))
    return tuple(callables)


@pytest.mark.parametrize("recipe", [None, "delayed", "current", "block", "mxfp8"])
def test_captured_layers_give_the_eager_losses(monkeypatch, recipe):
    """--capture records what the layers get in the first step, captures them with it and
    replays them from the second: with the capture emulated (torch's warm-up, then the layer
    itself), every loss and the validation loss equal the eager run's, and the capture leaves no
    recording hook behind."""
    from te_core import graphs
    from te_core.demo import capture
    from te_core.demo.train import make_recipe

    captured = []
    monkeypatch.setattr(graphs, "_graph_api", lambda device: _emulated_capture)
    real = capture.make_graphed_callables

    def spy(layers, samples, **kwargs):
        captured.append((layers, samples, kwargs))
        assert all(not layer._forward_pre_hooks for layer in layers)
        assert not torch.is_autocast_cache_enabled()  # torch's capture refuses the cache
        return real(layers, samples, **kwargs)

    monkeypatch.setattr(capture, "make_graphed_callables", spy)
    tokens, _ = load_corpus(200_000)
    train_tokens, val_tokens = split(tokens)
    cfg = RunConfig(model=SIZES["small"], steps=4, eval_batches=1)
    rcp = None if recipe is None else make_recipe(recipe)
    runs = [train("run", cfg, train_tokens, val_tokens, torch.device("cpu"), rcp, progress=False, capture=flag)
            for flag in (False, True)]
    assert runs[0].losses == runs[1].losses and runs[0].val_loss == runs[1].val_loss
    (layers, samples, kwargs), = captured
    m = cfg.model
    assert len(layers) == m.num_layers and kwargs["enabled"] is (rcp is not None) and kwargs["recipe"] is rcp
    assert kwargs["clone_param_grads_on_return"] is False  # one backward per step: .grad may be the buffers
    assert all(s[0].shape == (m.batch_size, m.seq_len, m.hidden_size) and s[0].requires_grad for s in samples)
    assert all(set(kw) == {"rotary_pos_emb"} for kw in kwargs["sample_kwargs"])


@pytest.mark.parametrize("flag, device, world, pinned", [
    (False, "meta", 1, False),  # the default: the OS places the threads
    (True, "meta", 1, True),  # any device type but "cpu" stands for an accelerator
    (True, "meta", 2, True),  # under torchrun too: each rank to a CPU of its own share
])
def test_host_pinning_follows_the_flag(monkeypatch, flag, device, world, pinned):
    import contextlib
    from argparse import Namespace

    import importlib

    from te_core import host_threads

    demo_main = importlib.import_module("te_core.demo.main")  # the module: the package exports main()

    calls = []

    @contextlib.contextmanager
    def fake_pin(device):
        calls.append(device)
        yield Namespace(cpu=5)
        calls.append("restored")

    monkeypatch.setattr(host_threads, "pin_host_threads", fake_pin)
    monkeypatch.setattr(demo_main.parallel, "launched_world", lambda: world)
    args = Namespace(pin_host_thread=flag)
    with demo_main._host_pinning(args, torch.device(device)):
        assert args.pinned_cpu == (5 if pinned else None)
    assert calls == ([torch.device(device), "restored"] if pinned else [])


def test_pin_host_thread_without_cpu_affinity_is_refused(monkeypatch, capsys):
    import os

    monkeypatch.delattr(os, "sched_setaffinity")
    assert main(["--pin-host-thread", "--steps", "2"]) == 2
    assert "--pin-host-thread needs CPU affinity (os.sched_setaffinity), which only Linux has" in capsys.readouterr().err
