"""GEMM helpers: the scaling mode follows the operands' types; plain tensors run ops.gemm."""
from __future__ import annotations

import pytest
import torch

from te_core import ops
from te_core.quantization import dgrad_gemm, fprop_gemm, gemm_slots, quantized_gemm, wgrad_gemm
from te_core.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MMParams, MXFP8BlockScaling

from .conftest import randn


@pytest.fixture
def modes(monkeypatch):
    seen = []
    real = ops.gemm_fp8

    def spy(a, b, a_scale_inv, b_scale_inv, **kwargs):
        seen.append(kwargs["scaling"])
        return real(a, b, a_scale_inv, b_scale_inv, **kwargs)

    monkeypatch.setattr(ops, "gemm_fp8", spy)
    return seen


@pytest.mark.parametrize("recipe,expected", [
    (DelayedScaling(), ["tensorwise"] * 3),
    (Float8CurrentScaling(), ["tensorwise"] * 3),
    (Float8BlockScaling(), ["block_1x128_128x128", "block_1x128_128x128", "block_1x128_1x128"]),
    (Float8BlockScaling(w_block_scaling_dim=1), ["block_1x128_1x128"] * 3),
    (MXFP8BlockScaling(), ["mxfp8"] * 3),
], ids=lambda v: type(v).__name__ if not isinstance(v, list) else "")
def test_scaling_mode_follows_operands(gen, modes, recipe, expected):
    state = recipe.make_state(gemm_slots(), torch.device("cpu"))
    x, w, dy = randn(gen, 64, 96), randn(gen, 32, 96), randn(gen, 64, 32)
    xq = state.quantizer("input").quantize(x, columnwise=True)
    wq = state.quantizer("weight").quantize(w, columnwise=True)
    dyq = state.quantizer("grad_output").quantize(dy, columnwise=True)
    outs = [fprop_gemm(xq, wq, out_dtype=torch.float32), dgrad_gemm(dyq, wq, out_dtype=torch.float32),
            wgrad_gemm(dyq, xq, out_dtype=torch.float32)]
    assert modes == expected
    wants = [x.double() @ w.double().T, dy.double() @ w.double(), dy.double().T @ x.double()]
    for out, want in zip(outs, wants):
        assert out.shape == want.shape
        assert ((out.double() - want).norm() / want.norm()) < 0.125  # FP8 relative (SQNR) bound, see test_linear


def test_plain_tensors_run_high_precision(gen):
    x, w, dy = randn(gen, 8, 12), randn(gen, 5, 12), randn(gen, 8, 5)
    torch.testing.assert_close(fprop_gemm(x, w, out_dtype=torch.float32), x @ w.T, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(dgrad_gemm(dy, w, out_dtype=torch.float32), dy @ w, rtol=1.3e-6, atol=1e-5)
    out = torch.ones(5, 12)
    wgrad_gemm(dy, x, out_dtype=torch.float32, out=out, accumulate=True)
    torch.testing.assert_close(out, 1 + dy.T @ x, rtol=1.3e-6, atol=1e-5)


def test_mismatched_operand_kinds_are_rejected(gen):
    block = Float8BlockScaling().make_state(gemm_slots(), torch.device("cpu"))
    delayed = DelayedScaling().make_state(gemm_slots(), torch.device("cpu"))
    a = block.quantizer("input").quantize(randn(gen, 16, 128))
    b = delayed.quantizer("weight").quantize(randn(gen, 16, 128))
    with pytest.raises(ValueError, match="no FP8 GEMM scaling mode for operands quantized as 1x128 .a. and tensor .b."):
        quantized_gemm(a, b, out_dtype=torch.float32)


@pytest.mark.parametrize("recipe,expected", [
    (DelayedScaling(), [True, False, False]),  # TE's fixed choice for delayed scaling
    (Float8CurrentScaling(), [True, False, False]),  # TE's fp8_gemm_* defaults
    (Float8CurrentScaling(fp8_gemm_fprop=MMParams(use_split_accumulator=True)), [False, False, False]),
    (Float8CurrentScaling(fp8_gemm_wgrad=MMParams(use_split_accumulator=False)), [True, False, True]),
    (Float8BlockScaling(), [False, False, False]),
], ids=["delayed", "current", "current-fprop-split", "current-wgrad-fast", "block"])
def test_recipe_decides_which_gemms_may_accumulate_fast(gen, monkeypatch, recipe, expected):
    """fast_accumulation reaches ops.gemm_fp8 per GEMM as the recipe's fp8_gemm_* say (TE: forward
    fast, gradients split; block scaling split everywhere)."""
    seen = []
    real = ops.gemm_fp8
    monkeypatch.setattr(ops, "gemm_fp8", lambda *a, **k: (seen.append(k.get("fast_accumulation")), real(*a, **k))[1])
    state = recipe.make_state(gemm_slots(), torch.device("cpu"))
    x, w, dy = randn(gen, 64, 128), randn(gen, 128, 128), randn(gen, 64, 128)
    xq = state.quantizer("input").quantize(x, columnwise=True)
    wq = state.quantizer("weight").quantize(w, columnwise=True)
    dyq = state.quantizer("grad_output").quantize(dy, columnwise=True)
    fprop_gemm(xq, wq, out_dtype=torch.float32)
    dgrad_gemm(dyq, wq, out_dtype=torch.float32)
    wgrad_gemm(dyq, xq, out_dtype=torch.float32)
    assert seen == expected


def test_plain_quantized_gemm_accumulates_in_float32(gen, monkeypatch):
    seen = []
    real = ops.gemm_fp8
    monkeypatch.setattr(ops, "gemm_fp8", lambda *a, **k: (seen.append(k.get("fast_accumulation")), real(*a, **k))[1])
    state = DelayedScaling().make_state(gemm_slots(), torch.device("cpu"))
    xq = state.quantizer("input").quantize(randn(gen, 32, 64))
    wq = state.quantizer("weight").quantize(randn(gen, 16, 64))
    quantized_gemm(xq, wq, out_dtype=torch.float32)
    assert seen == [False]


@pytest.fixture
def lying_backend(monkeypatch):
    """Selects a backend whose gemm / gemm_fp8 run the reference, then let `lie` change the result."""
    import types

    from te_core import backend
    from te_core.backend import hookimpl, registry
    from te_core.backend.types import API_VERSION, BackendInfo, Capabilities, OpImpl
    from te_core.reference.plugin import implementations

    reference, lies = implementations(), {}

    def op(name):
        return OpImpl(lambda *args, **kwargs: lies.get(name, lambda y: y)(reference[name](*args, **kwargs)))

    plugin = types.SimpleNamespace(
        te_backend_info=hookimpl(lambda: BackendInfo(name="liar", device_type="cpu", api_version=API_VERSION)),
        te_backend_available=hookimpl(lambda: (True, "test backend")),
        te_backend_ops=hookimpl(lambda: {"gemm": op("gemm"), "gemm_fp8": op("gemm_fp8")}),
        te_backend_capabilities=hookimpl(lambda device: Capabilities(
            fp8_formats={"E4M3": 448.0, "E5M2": 57344.0}, scaling_modes=frozenset({"tensorwise"}),
            device_name="test", arch="test")),
    )
    entry = types.SimpleNamespace(name="liar", load=lambda: plugin,
                                  dist=types.SimpleNamespace(metadata={"Name": "te-backend-liar"}, version="1.0"))
    monkeypatch.setattr(registry, "_entry_points", lambda: [entry])
    registry.REGISTRY.reset()
    backend.set_backend("liar")
    yield lies
    monkeypatch.undo()
    registry.REGISTRY.reset()


@pytest.mark.filterwarnings("ignore::te_core.backend.BackendFallbackWarning")
@pytest.mark.parametrize("recipe", [None, DelayedScaling()], ids=["high-precision", "fp8"])
@pytest.mark.parametrize("lie, got", [
    (lambda y: y[:-1], r"shape \(15, 16\)"),  # one row short: silently short before, or a reshape error
    (lambda y: y.double(), r"torch.float64"),
], ids=["rows", "dtype"])
def test_a_gemm_breaking_its_contract_is_named_as_the_backends_bug(gen, lying_backend, recipe, lie, got):
    from te_core.backend import BackendError
    from te_core.modules.linear import Linear
    from te_core.quantization import autocast

    layer = Linear(32, 16)
    lying_backend.update(gemm=lie, gemm_fp8=lie)
    with pytest.raises(BackendError, match=r"backend 'liar' broke the contract of gemm(_fp8)?: .*" + got
                       + r".*requires shape \(16, 16\).*bug in the backend, not in your inputs"):
        with autocast(enabled=recipe is not None, recipe=recipe):
            layer(randn(gen, 4, 4, 32))
