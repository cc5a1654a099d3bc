"""Deferred initialization, as Transformer Engine's: a module built on device="meta" holds no
values until reset_parameters() materializes its parameters on te-core's device and initializes
them as construction does, re-quantizing FP8 primary weights (quantized_model_init). Under one
seed it then equals a module built directly: the same parameter bytes, FP8 data and scales,
scaling state, and the same outputs and gradients under te.autocast. module.to_empty() keeps an
FP8 primary weight an FP8 tensor of its kind; a scaling state made on meta starts afresh on the
device the module runs on; a module on meta that was never initialized refuses to run, saying
what to do. (FSDP2's sharded parameters: tests/distributed/test_fsdp2_meta_init.py.)"""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core import recipe
from te_core.quantization import QuantizedTensor
from te_core.quantization.scaling import ScalingGroup

from ._compare import seeded

RECIPES = {"none": None, "delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
           "block": recipe.Float8BlockScaling, "mxfp8": recipe.MXFP8BlockScaling}
FP8_RECIPES = [name for name in RECIPES if name != "none"]
H, FFN, ROWS = 64, 128, 64
MODULES = {  # (build from device, call on input x)
    "Linear": (lambda d: te.Linear(H, H, device=d), lambda m, x: m(x)),
    "LayerNormLinear": (lambda d: te.LayerNormLinear(H, H, device=d), lambda m, x: m(x)),
    "LayerNormMLP": (lambda d: te.LayerNormMLP(H, FFN, device=d), lambda m, x: m(x)),
    "GroupedLinear": (lambda d: te.GroupedLinear(2, H, H, device=d), lambda m, x: m(x, [ROWS // 2, ROWS // 2])),
    "LayerNorm": (lambda d: te.LayerNorm(H, device=d), lambda m, x: m(x)),
    "RMSNorm": (lambda d: te.RMSNorm(H, device=d), lambda m, x: m(x)),
    "TransformerLayer": (lambda d: te.TransformerLayer(H, FFN, 4, device=d, hidden_dropout=0.0,
                                                       attention_dropout=0.0, layer_type="decoder"),
                         lambda m, x: m(x.view(ROWS // 2, 2, H), encoder_output=x.view(ROWS // 2, 2, H))),
}


def _reset_all(model: torch.nn.Module) -> None:
    """What a Transformer Engine user runs after fully_shard: reset_parameters() on every module
    that has one (containers have none, as in TE: their submodules each initialize themselves)."""
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _build(name: str, rec_name: str, device, *, seed: int = 5, preserve: bool = False, reset: bool = True):
    rec = RECIPES[rec_name]
    torch.manual_seed(seed)
    with te.quantized_model_init(enabled=rec is not None, recipe=rec and rec(),
                                 preserve_high_precision_init_val=preserve):
        module = MODULES[name][0](device)
    if device == "meta" and reset:
        torch.manual_seed(seed)
        _reset_all(module)
    return module


def _assert_same_parameters(got: torch.nn.Module, want: torch.nn.Module) -> None:
    assert list(got.state_dict()) == list(want.state_dict())
    for (name, p), (_, q) in zip(got.named_parameters(), want.named_parameters()):
        assert type(p) is type(q) and isinstance(p, torch.nn.Parameter), f"{name}: {type(p)} vs {type(q)}"
        assert p.device == q.device and p.dtype == q.dtype and p.requires_grad == q.requires_grad, name
        if isinstance(q, QuantizedTensor):
            for key, value in q._payload().items():  # FP8 bytes and scales, both layouts
                mine = getattr(p, key)
                assert (mine is None) == (value is None), f"{name}.{key}"
                if value is not None:
                    assert torch.equal(mine.view(torch.uint8) if mine.dtype.itemsize == 1 else mine,
                                       value.view(torch.uint8) if value.dtype.itemsize == 1 else value), \
                        f"{name}.{key} differs"
        else:
            assert torch.equal(p, q), f"{name} differs"
    for module, twin in zip(got.modules(), want.modules()):
        if isinstance(module, te.modules._base.QuantizedModule):
            for direction, slots in twin.quantization_state().items():
                for slot, entry in slots.items():
                    for key, value in entry.items():
                        assert torch.equal(module.quantization_state()[direction][slot][key], value), \
                            f"{direction}.{slot}.{key}"
            assert module.device == twin.device


def _run(name: str, module, rec_name: str):
    x = torch.randn(ROWS, H, generator=seeded(11)).requires_grad_()
    rec = RECIPES[rec_name]
    with te.autocast(enabled=rec is not None, recipe=rec and rec()):
        out = MODULES[name][1](module, x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("rec_name", list(RECIPES))
@pytest.mark.parametrize("name", list(MODULES))
def test_reset_after_meta_equals_the_directly_built_module(name, rec_name, module_backend):
    if rec_name != "none" and name in ("LayerNorm", "RMSNorm"):
        pytest.skip("no GEMM: nothing to quantize")
    direct = _build(name, rec_name, None)
    on_meta = _build(name, rec_name, "meta", reset=False)
    assert all(p.is_meta for p in on_meta.parameters())
    torch.manual_seed(5)
    _reset_all(on_meta)
    assert all(p.device == module_backend.device for p in on_meta.parameters())
    _assert_same_parameters(on_meta, direct)
    for got, want in zip(_run(name, on_meta, rec_name), _run(name, direct, rec_name)):
        assert (got is None) == (want is None)
        if want is not None:
            assert torch.equal(got, want)
    _assert_same_parameters(on_meta, direct)  # the scaling states updated alike


@pytest.mark.parametrize("rec_name", ["none", "delayed", "current"])
def test_reset_of_a_built_module_reinitializes_the_same_parameters_in_place(rec_name, module_backend):
    module = _build("LayerNormMLP", rec_name, None, seed=1)
    before = dict(module.named_parameters())
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    torch.manual_seed(5)
    module.reset_parameters()
    assert all(p is before[n] for n, p in module.named_parameters())  # an optimizer's references stay good
    direct = _build("LayerNormMLP", rec_name, None)
    for (name, p), (_, q) in zip(module.named_parameters(), direct.named_parameters()):
        got, want = (p.dequantize(), q.dequantize()) if isinstance(q, QuantizedTensor) else (p, q)
        assert torch.equal(got, want), name


@pytest.mark.parametrize("rec_name", FP8_RECIPES)
def test_preserved_values_are_those_from_before_quantization(rec_name, module_backend):
    on_meta = _build("LayerNormMLP", rec_name, "meta", preserve=True, reset=False)
    assert not hasattr(on_meta.fc1_weight, "get_high_precision_init_val")  # nothing to keep yet
    torch.manual_seed(5)
    on_meta.reset_parameters()
    plain = _build("LayerNormMLP", "none", None)  # the initializer's values, not quantized
    direct = _build("LayerNormMLP", rec_name, None, preserve=True)
    for name in ("fc1_weight", "fc2_weight"):
        kept = getattr(on_meta, name).get_high_precision_init_val()
        assert kept.device.type == "cpu" and torch.equal(kept, getattr(plain, name).detach().cpu())
        assert torch.equal(kept, getattr(direct, name).get_high_precision_init_val())
    _assert_same_parameters(on_meta, direct)


@pytest.mark.parametrize("rec_name", FP8_RECIPES)
def test_to_empty_keeps_fp8_primary_weights_quantized(rec_name, module_backend):
    device = module_backend.device
    on_meta = _build("Linear", rec_name, "meta", reset=False)
    kind = type(on_meta.weight)
    on_meta.to_empty(device=device)
    weight = on_meta.weight
    assert type(weight) is kind and isinstance(weight, torch.nn.Parameter) and weight.requires_grad
    assert weight.device == device and all(t.device == device for t in weight._payload().values()
                                           if isinstance(t, torch.Tensor))
    assert weight.tensor_model_parallel and weight.partition_dim == 0  # its attributes are kept
    torch.manual_seed(5)
    on_meta.reset_parameters()
    assert on_meta.weight is weight  # filled in place
    _assert_same_parameters(on_meta, _build("Linear", rec_name, None))
    direct = _build("Linear", rec_name, None)
    empty = direct.to_empty(device=device).weight
    assert type(empty) is kind and empty.device == device


def test_a_scaling_state_made_on_meta_starts_afresh_on_the_device(module_backend):
    """The state holds no values on meta: the first forward on the device starts it as a module
    built there does (a zero history, scale 1, every slot fresh), rather than copying meta."""
    rec = recipe.DelayedScaling()
    torch.manual_seed(5)
    on_meta = te.Linear(H, H, device="meta")
    te.init_quantization_state(on_meta, rec)  # a state made while the weights are on meta
    on_meta.to_empty(device=module_backend.device)
    torch.manual_seed(5)
    on_meta.reset_parameters()
    direct = _build("Linear", "none", None)
    got, want = _run("Linear", on_meta, "delayed"), _run("Linear", direct, "delayed")
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    _assert_same_parameters(on_meta, direct)
    group = ScalingGroup(["a", "b"], torch.float8_e4m3fn, rec, torch.device("meta"))
    group.fresh.clear()
    group.to_device(module_backend.device)
    assert torch.equal(group.scale, torch.ones(2, device=module_backend.device))
    assert torch.equal(group.amax_history, torch.zeros(rec.amax_history_len, 2, device=module_backend.device))
    assert group.fresh == {0, 1}


@pytest.mark.parametrize("name", list(MODULES))
def test_a_meta_module_that_was_never_initialized_refuses_to_run(name, module_backend):
    module = _build(name, "none", "meta", reset=False)
    x = torch.randn(ROWS, H)
    with pytest.raises(RuntimeError, match=r"parameters are on the meta device .*module\.to_empty\(device=\.\.\.\) "
                                           r"then module\.reset_parameters\(\)"):
        MODULES[name][1](module, x)


def test_names_splits_and_parallel_attributes_survive(module_backend):
    split = {"query_": 16, "key_": 16, "value_": 32}
    torch.manual_seed(5)
    direct = te.LayerNormLinear(H, H, parameters_split=split, parallel_mode="column")
    on_meta = te.LayerNormLinear(H, H, parameters_split=split, parallel_mode="column", device="meta")
    on_meta.query_weight.custom_flag = "kept"
    torch.manual_seed(5)
    on_meta.reset_parameters()
    _assert_same_parameters(on_meta, direct)
    assert on_meta.query_weight.custom_flag == "kept"
    for name, p in on_meta.named_parameters():
        if not name.startswith("layer_norm"):
            assert p.tensor_model_parallel and p.partition_dim == 0 and p.partition_stride == 1, name
    norm = te.RMSNorm(H, sequence_parallel=True, device="meta")
    norm.reset_parameters()
    assert norm.weight.sequence_parallel is True and not norm.weight.is_meta


def test_defer_init_and_the_earlier_init_method_argument(module_backend):
    module = te.Linear(H, H, device="meta")
    module.reset_parameters(defer_init=True)
    assert module.weight.is_meta
    module.reset_parameters(torch.nn.init.ones_)  # te-core's earlier positional init_method
    assert torch.equal(module.weight, torch.ones(H, H))
    module.reset_parameters(init_method=torch.nn.init.zeros_)
    assert not module.weight.any()
    custom = te.Linear(H, H, init_method=torch.nn.init.ones_, device="meta")
    custom.reset_parameters()  # the constructor's init_method, as construction
    assert torch.equal(custom.weight, torch.ones(H, H))
