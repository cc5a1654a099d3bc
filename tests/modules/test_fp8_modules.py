"""The GEMM modules under te.autocast with every recipe, against plain PyTorch in float32:
within the E4M3 tolerance forward and the E5M2 tolerance for gradients (HYBRID), measured
relative to the largest reference value."""

import re

import numpy as np
import pytest
import torch

import te_core.modules as tm
from te_core import recipe
from te_core.quantization import QuantizedTensor, autocast

from ._compare import randomize_, seeded
from .plain import PlainNormLinear, PlainNormMLP

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
    "mxfp8": recipe.MXFP8BlockScaling,
}
E4M3 = dict(rtol=0.125, atol=0.0675)
E5M2 = dict(rtol=0.25, atol=0.125)


def assert_close_scaled(actual, expected, tol, what):
    scale = expected.abs().max().clamp_min(1e-12)
    torch.testing.assert_close(actual / scale, expected / scale, **tol, msg=lambda m: f"{what}: {m}")


def fp8_vs_plain(te_mod, ref, x, rec, steps=2):
    """Runs `steps` FP8 iterations (delayed scaling needs one to calibrate), compares the last."""
    ref.load_state_dict(te_mod.state_dict(), strict=False)
    for _ in range(steps):
        te_mod.zero_grad()
        x_te = x.clone().requires_grad_(True)
        with autocast(recipe=rec):
            y = te_mod(x_te)
        dy = torch.randn(y.shape, generator=seeded(9))
        y.backward(dy)
    x_ref = x.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    y_ref.backward(dy)
    assert not torch.equal(y, y_ref), "FP8 output is bit-identical to float32: FP8 did not run"
    assert_close_scaled(y, y_ref, E4M3, "forward")
    assert_close_scaled(x_te.grad, x_ref.grad, E5M2, "dx")
    ref_params = dict(ref.named_parameters())
    for name, p in te_mod.named_parameters():
        assert_close_scaled(p.grad, ref_params[name].grad, E5M2, f"d{name}")


@pytest.mark.parametrize("rec", list(RECIPES))
def test_layernorm_linear_fp8(rec):
    torch.manual_seed(0)
    te_mod = tm.LayerNormLinear(64, 96, normalization="RMSNorm")
    randomize_(te_mod, seed=11, std=0.2)
    fp8_vs_plain(te_mod, PlainNormLinear(64, 96, "RMSNorm"), torch.randn(2, 32, 64), RECIPES[rec]())


@pytest.mark.parametrize("rec", list(RECIPES))
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp_fp8(rec, activation):
    torch.manual_seed(0)
    te_mod = tm.LayerNormMLP(64, 128, activation=activation)
    randomize_(te_mod, seed=12, std=0.2)
    fp8_vs_plain(te_mod, PlainNormMLP(64, 128, activation, "LayerNorm"), torch.randn(64, 64), RECIPES[rec]())


def test_delayed_scaling_state_of_layernorm_mlp_tracks_amaxes():
    torch.manual_seed(0)
    te_mod = tm.LayerNormMLP(32, 64)
    x = torch.randn(32, 32)
    with autocast(recipe=recipe.DelayedScaling(amax_history_len=2)):
        te_mod(x.requires_grad_(True)).sum().backward()
    state = te_mod.quantization_state()
    assert set(state["forward"]) == {"fc1_input", "fc1_weight", "fc2_input", "fc2_weight"}
    assert set(state["backward"]) == {"fc1_grad_output", "fc2_grad_output"}
    w_amax = te_mod.fc1_weight.detach().abs().max()
    hist = state["forward"]["fc1_weight"]["amax_history"]
    assert torch.isclose(hist.max(), w_amax), (hist, w_amax)
    torch.testing.assert_close(state["forward"]["fc1_weight"]["scale"], (448.0 / w_amax).reshape(1))


@pytest.mark.parametrize(
    "rec, rows, match",
    [
        ("block", 24, r"LayerNormMLP: FP8 GEMM.*multiple of"),  # (tensor-wise recipes pad such GEMMs)
        ("mxfp8", 48, r"LayerNormMLP: FP8 GEMM.*multiple of"),
    ],
)
def test_unquantizable_shapes_raise_clear_error(rec, rows, match):
    te_mod = tm.LayerNormMLP(64, 128)
    with pytest.raises(ValueError, match=match):
        with autocast(recipe=RECIPES[rec]()):
            te_mod(torch.randn(rows, 64))


def test_weights_cached_across_microbatches():
    torch.manual_seed(0)
    te_mod = tm.LayerNormLinear(32, 32)
    rec = recipe.Float8CurrentScaling()
    x = torch.randn(16, 32)
    with autocast(recipe=rec):
        y1 = te_mod(x, is_first_microbatch=True)
    with torch.no_grad():
        te_mod.weight.mul_(2.0)  # a stale cache must ignore this change
    with autocast(recipe=rec):
        y2 = te_mod(x, is_first_microbatch=False)
        y3 = te_mod(x, is_first_microbatch=None)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    assert not torch.allclose(y2, y3)


BUILD_AND_CALL = {
    "Linear": (lambda: tm.Linear(32, 32), lambda m, x, flag: m(x, is_first_microbatch=flag)),
    "LayerNormLinear": (lambda: tm.LayerNormLinear(32, 32), lambda m, x, flag: m(x, is_first_microbatch=flag)),
    "LayerNormMLP": (lambda: tm.LayerNormMLP(32, 32), lambda m, x, flag: m(x, is_first_microbatch=flag)),
    "GroupedLinear": (lambda: tm.GroupedLinear(2, 32, 32), lambda m, x, flag: m(x, [16, 0], is_first_microbatch=flag)),
    "TransformerLayer": (lambda: tm.TransformerLayer(32, 32, 2, hidden_dropout=0.0, attention_dropout=0.0),
                         lambda m, x, flag: m(x.view(16, 1, 32), is_first_microbatch=flag)),
}


@pytest.mark.parametrize("name", list(BUILD_AND_CALL))
@pytest.mark.parametrize("value", [1.0, "yes", 2, [True]])
def test_is_first_microbatch_refuses_values_read_by_truthiness(name, value):
    # the weight cache tests `is False` / `is None`: 1.0 or "yes" used to run as neither True nor False
    build, call = BUILD_AND_CALL[name]
    module, x = build(), torch.randn(16, 32)
    where = "LayerNormLinear" if name == "TransformerLayer" else name  # (its first quantized submodule)
    for context in (autocast(recipe=recipe.Float8CurrentScaling()), autocast(enabled=False)):
        with context, pytest.raises(TypeError, match=rf"{where}: is_first_microbatch must be True, False or None, "
                                                    rf"got {re.escape(repr(value))}"):
            call(module, x, value)


def test_is_first_microbatch_takes_numpy_bools_as_bools():
    module, x = tm.Linear(32, 32), torch.randn(16, 32)
    with autocast(recipe=recipe.Float8CurrentScaling()):
        y1 = module(x, is_first_microbatch=np.bool_(True))
        with torch.no_grad():
            module.weight.mul_(2.0)  # the cached weight is read back, as with False
        y2 = module(x, is_first_microbatch=np.bool_(False))
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)


def test_quantized_model_init_keeps_fp8_primary_weights():
    from te_core.quantization import QuantizedTensor, quantized_model_init

    torch.manual_seed(0)
    rec = recipe.Float8CurrentScaling()
    with quantized_model_init(recipe=rec):
        te_mod = tm.LayerNormMLP(32, 64)
    assert isinstance(te_mod.fc1_weight, QuantizedTensor) and isinstance(te_mod.fc2_weight, QuantizedTensor)
    ref = PlainNormMLP(32, 64, "gelu", "LayerNorm")
    ref.load_state_dict(te_mod.state_dict(), strict=False)  # the dequantized weights
    x = torch.randn(32, 32)
    with autocast(recipe=rec):
        y = te_mod(x)
    assert_close_scaled(y, ref(x), E4M3, "forward")
    y.sum().backward()
    assert te_mod.fc1_weight.grad is not None and te_mod.fc1_weight.grad.shape == (64, 32)


def test_quantized_model_init_layernorm_linear_and_grouped_linear():
    from te_core.quantization import QuantizedTensor, quantized_model_init

    with quantized_model_init(recipe=recipe.Float8CurrentScaling()):
        lnl, grouped = tm.LayerNormLinear(32, 32), tm.GroupedLinear(2, 32, 32)
    assert isinstance(lnl.weight, QuantizedTensor) and isinstance(grouped.weight1, QuantizedTensor)
    assert not isinstance(tm.LayerNormLinear(32, 32).weight, QuantizedTensor)


@pytest.mark.parametrize("rec_name", sorted(RECIPES))
def test_deepcopy_keeps_fp8_primary_weights_trainable(rec_name):
    """A deep copy of a model with FP8 primary weights (an EMA or reference copy) keeps them
    trainable parameters with their own quantizers: the copy's gradients equal the original's."""
    import copy

    from te_core.quantization import QuantizedTensor, quantized_model_init

    torch.manual_seed(0)
    rec = RECIPES[rec_name]()
    with quantized_model_init(recipe=rec):
        original = torch.nn.Sequential(tm.Linear(64, 64), tm.LayerNormMLP(64, 128))
    twin = copy.deepcopy(original)
    names = [name for name, p in original.named_parameters() if isinstance(p, QuantizedTensor)]
    assert len(names) == 3 and [n for n, _ in twin.named_parameters()] == [n for n, _ in original.named_parameters()]
    x = torch.randn(32, 64)
    for model in (original, twin):
        with autocast(recipe=rec):
            y = model(x)
        y.backward(torch.randn(y.shape, generator=seeded(3)))
    copied = dict(twin.named_parameters())
    for name, param in original.named_parameters():
        got = copied[name]
        assert got.requires_grad and isinstance(got, torch.nn.Parameter), name
        assert got.grad is not None and torch.equal(got.grad, param.grad), name
        if name in names:
            assert got.quantizer is not param.quantizer, name  # the copy requantizes on its own


@pytest.mark.parametrize("rec", ["block", "mxfp8"])
def test_frozen_input_still_trains_norm_and_weights(rec):
    """x without requires_grad: the norm parameters still need the dgrad, so the weight keeps
    its column-wise copy (block scaling cannot transpose a row-wise copy after the fact)."""
    torch.manual_seed(0)
    lnl, mlp = tm.LayerNormLinear(64, 64), tm.LayerNormMLP(64, 128)
    grouped = tm.GroupedLinear(2, 64, 64)
    x = torch.randn(64, 64)
    with autocast(recipe=RECIPES[rec]()):
        (lnl(x).sum() + mlp(x).sum() + grouped(x, [32, 32]).sum()).backward()
    assert lnl.layer_norm_weight.grad.abs().sum() > 0 and mlp.layer_norm_weight.grad.abs().sum() > 0
    assert grouped.weight0.grad.abs().sum() > 0
    lnl.layer_norm_weight.requires_grad_(False)
    lnl.layer_norm_bias.requires_grad_(False)
    with autocast(recipe=RECIPES[rec]()):
        lnl(x).sum().backward()  # nothing upstream needs the dgrad: it is skipped


def _saved_bytes(module, x, rec=None):
    """Bytes of the distinct storages autograd keeps for backward (quantized tensors counted by
    their FP8 payload)."""
    storages = {}

    def pack(t):
        inner = t._payload().values() if hasattr(t, "_payload") else (t,)
        for part in inner:
            if isinstance(part, torch.Tensor):
                storage = part.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if rec is None:
            module(x)
        else:
            with autocast(recipe=rec):
                module(x)
    return sum(storages.values())


@pytest.mark.parametrize("rec", ["delayed", "current", "block"])
def test_fp8_keeps_fewer_bytes_for_backward_than_bf16(rec):
    """Backward reads only column-wise FP8 copies, so an FP8 LayerNormMLP keeps less than its
    bf16 run (this failed while row-wise copies of operands and weights were saved too)."""
    torch.manual_seed(0)
    mlp = tm.LayerNormMLP(128, 512, params_dtype=torch.bfloat16)
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    bf16 = _saved_bytes(mlp, x)
    fp8 = _saved_bytes(mlp, x, RECIPES[rec]())
    assert fp8 < 0.8 * bf16, (fp8, bf16)


@pytest.mark.parametrize("rec_name", ["delayed", "current"])
def test_quantized_primary_weights_load_trained_values_without_saturating(rec_name):
    """A checkpoint of trained FP8 primary weights (saved dequantized) loads into a freshly
    initialized model: the fresh model's delayed scale, taken from its small init values, must
    not clip the loaded ones; the scaling state comes from the checkpoint."""
    from te_core.quantization import quantized_model_init

    torch.manual_seed(0)
    rec = RECIPES[rec_name]()
    with quantized_model_init(recipe=rec):
        trained, fresh = tm.Linear(32, 48), tm.Linear(32, 48)
    big = torch.randn(48, 32) * 40  # far beyond a fresh init's range
    x = torch.randn(16, 32)
    for _ in range(2):  # (under delayed scaling the second copy uses the scale updated from the first's amax)
        with torch.no_grad():
            trained.weight.copy_(big)
        with autocast(recipe=rec):
            trained(x).sum().backward()  # scaling state worth restoring
    saved = trained.state_dict()
    fresh.load_state_dict(saved)
    want = saved["weight"].float()
    got = fresh.weight.dequantize().float()
    assert want.abs().max() > 60
    torch.testing.assert_close(got, want, rtol=0.125, atol=0.0675)
    for direction, slots in trained.quantization_state().items():
        for slot, entry in slots.items():
            for key, t in entry.items():
                assert torch.equal(fresh.quantization_state()[direction][slot][key], t), (direction, slot, key)
    with autocast(recipe=rec):
        assert_close_scaled(fresh(x), trained(x), E4M3, "forward after loading")


def test_a_resumed_delayed_scaling_fp8_weight_is_the_saved_one_exactly():
    """FP8 primary weights trained under delayed scaling (an optimizer requantizes them with the
    module's scale) are saved dequantized; a fresh model loading the checkpoint (its extra state
    restores that scale) gets the same FP8 bytes and scale_inv back, so the resumed step equals
    the uninterrupted one bit for bit (re-cast by their own amax, some values rounded otherwise)."""
    from te_core.optimizers import FusedAdam
    from te_core.quantization import quantized_model_init

    torch.manual_seed(0)
    rec = recipe.DelayedScaling()
    with quantized_model_init(recipe=rec):
        model = torch.nn.Sequential(tm.LayerNormLinear(64, 128), tm.Linear(128, 64))
        twin = torch.nn.Sequential(tm.LayerNormLinear(64, 128), tm.Linear(128, 64))
    x = torch.randn(32, 64)

    def step(m, opt):
        with autocast(recipe=rec):
            loss = m(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    opt = FusedAdam(model.parameters(), lr=1e-3, master_weights=True)
    for _ in range(4):
        step(model, opt)
    twin.load_state_dict(model.state_dict())
    twin_opt = FusedAdam(twin.parameters(), lr=1e-3, master_weights=True)
    twin_opt.load_state_dict(opt.state_dict())
    for i in (0, 1):
        saved, loaded = model[i].weight, twin[i].weight
        assert torch.equal(loaded._data.view(torch.uint8), saved._data.view(torch.uint8)), i
        assert torch.equal(loaded._scale_inv, saved._scale_inv), i
    assert torch.equal(step(twin, twin_opt), step(model, opt))
    with autocast(recipe=rec):
        assert torch.equal(twin(x), model(x))


@pytest.mark.parametrize("kind", ["LayerNormMLP", "LayerNormLinear", "Linear"])
@pytest.mark.parametrize("rec_name", sorted(RECIPES))
def test_fp8_weights_built_for_inference_keep_no_column_wise_copy(rec_name, kind):
    """quantized_model_init under torch.no_grad (an inference model): tensor-wise FP8 weights keep
    only their row-wise data (Transformer Engine keeps no column-wise copy either), forwards under
    no_grad or inference_mode make none (TE's test_sanity test_inference_mode) and give the same
    output, and training later remakes the copy exactly (the same gradients as weights built with
    gradients on). Block and MXFP8 weights, whose column-wise copy has scales of its own, keep it."""
    from te_core.quantization import quantized_model_init

    rec = RECIPES[rec_name]()
    built = {}
    for grad in (True, False):
        torch.manual_seed(0)
        with torch.set_grad_enabled(grad), quantized_model_init(recipe=rec):
            built[grad] = getattr(tm, kind)(32, 64) if kind != "Linear" else tm.Linear(32, 32)
    trained, inference = built[True], built[False]
    tensorwise = rec_name in ("delayed", "current")
    names = [n for n, p in trained.named_parameters() if isinstance(p, QuantizedTensor)]
    assert names
    for name in names:
        assert getattr(trained, name).has_columnwise
        assert getattr(inference, name).has_columnwise is not tensorwise, name
        assert torch.equal(getattr(inference, name).dequantize(), getattr(trained, name).dequantize())
    x = torch.randn(32, 32, generator=seeded(4))
    for no_autograd in (torch.no_grad, torch.inference_mode):
        with no_autograd(), autocast(recipe=rec):
            assert torch.equal(inference(x), trained(x))
        for name in names:
            assert getattr(inference, name).has_columnwise is not tensorwise, (name, no_autograd)
    grads = {}
    for key, module in built.items():
        x_in = x.clone().requires_grad_(True)
        with autocast(recipe=rec):
            y = module(x_in)
        y.backward(torch.randn(y.shape, generator=seeded(5)))
        grads[key] = [x_in.grad] + [p.grad for p in module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    assert getattr(inference, names[0]).has_columnwise  # remade by the backward


@pytest.mark.parametrize("built, run", [("mxfp8", "delayed"), ("block", "current")])
def test_fp8_weights_under_another_recipe_kind_say_why(built, run):
    """A weight kept only in FP8 stays in its recipe's format: run under a recipe of another kind,
    the error names that cause, not only the two scaling modes."""
    from te_core.quantization import quantized_model_init

    with quantized_model_init(recipe=RECIPES[built]()):
        layer = tm.Linear(128, 128)
    with pytest.raises(ValueError, match=r"no FP8 GEMM scaling mode.*kept only in FP8 \(te.quantized_model_init\) "
                                         r"stays in the format of the recipe it was made under"):
        with autocast(recipe=RECIPES[run]()):
            layer(torch.randn(128, 128, generator=seeded(6)))


def _user_warnings(call, rcp) -> list:
    """The UserWarning messages `call()` raises under autocast(recipe=rcp)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with autocast(recipe=rcp):
            call()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_a_recipe_of_another_kind_warns_once_as_transformer_engine_does():
    """Switching a module to a recipe of another kind warns (Transformer Engine's words: "Recipe
    type changed"), once: the module's scaling state for the old kind is dropped. Recipe objects
    of the same kind, equal or not, never warn."""
    layer = tm.Linear(32, 32)
    x = torch.randn(16, 32, generator=seeded(8))

    def run(rcp):
        return _user_warnings(lambda: layer(x).sum().backward(), rcp)

    assert run(recipe.DelayedScaling()) == []
    assert run(recipe.DelayedScaling(amax_history_len=4)) == []  # same kind: the state carries over
    first = run(RECIPES["current"]())
    assert len(first) == 1 and first[0].startswith("Recipe type changed from DelayedScaling to "
                                                   "Float8CurrentScaling. This may affect model behavior")
    assert "drops its quantization state for DelayedScaling" in first[0]
    assert run(RECIPES["current"]()) == []


def test_fp8_primary_weights_under_a_changed_recipe_warn_as_transformer_engine_does():
    """FP8 primary weights run under a recipe of their kind with other fields warn ("Quantizer is
    being updated", Transformer Engine's words) once, naming both recipes; an equal recipe does not."""
    from te_core.quantization import quantized_model_init

    with quantized_model_init(recipe=recipe.DelayedScaling(amax_history_len=1024)):
        layer = tm.Linear(32, 32)
    x = torch.randn(16, 32, generator=seeded(9))

    def run(rcp):
        return _user_warnings(lambda: layer(x), rcp)

    assert run(recipe.DelayedScaling(amax_history_len=1024)) == []
    changed = run(recipe.DelayedScaling(amax_history_len=1))
    assert len(changed) == 1 and changed[0].startswith("Quantizer is being updated, this may affect model behavior")
    assert "amax_history_len=1024" in changed[0] and "amax_history_len=1," in changed[0]
    assert run(recipe.DelayedScaling(amax_history_len=1)) == []
