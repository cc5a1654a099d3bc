"""Transformer Engine checkpoints across its releases: extra state that holds no scales (TE
2.0-2.3's pickled None, stateless recipes' records), state of another number of GEMMs, TE 1.x's
state without a recipe, the `_extra_state` of TE's norms (both ways), and FP8 primary weights
pickled as TE's Float8Tensor."""
from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import sys
import types
import warnings

import pytest
import torch

import te_core as te
from te_core.compat.te_state_dict_names import to_transformer_engine_state_dict
from te_core.compat.transformer_engine import uninstall_transformer_engine
from te_core.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling

from .test_te_checkpoints import TE_RECIPE, _delayed_state, _te_extra_state, te_recipe  # noqa: F401  (fixture)


def _pickled(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _te_record_class(te_recipe, name: str, **fields):
    """A recipe class with TE's module path and name, so that pickle writes TE's reference."""
    cls = dataclasses.make_dataclass(name, [(k, type(v), dataclasses.field(default=v)) for k, v in fields.items()],
                                     frozen=True)
    cls.__module__, cls.__qualname__ = TE_RECIPE, name
    setattr(te_recipe, name, cls)
    return cls


def _stateless_records(te_recipe) -> dict:
    """What TE 2.0-2.17 pickle for a module trained with a stateless recipe: the recipe, no scales."""
    qparams = _te_record_class(te_recipe, "QParams", power_2_scale=False, amax_epsilon=0.0)
    recipes = {"MXFP8BlockScaling": dict(margin=0, fp8_format=te_recipe.Format.E4M3),
               "Float8CurrentScaling": dict(fp8_format=te_recipe.Format.HYBRID, fp8_quant_fwd_inp=qparams()),
               "Float8BlockScaling": dict(fp8_format=te_recipe.Format.E4M3, x_block_scaling_dim=1)}
    return {name: {"recipe": _te_record_class(te_recipe, name, **fields)(),
                   "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 1}}
            for name, fields in recipes.items()}


@pytest.mark.parametrize("written", ["TE 2.0-2.3 None", "MXFP8BlockScaling", "Float8CurrentScaling",
                                     "Float8BlockScaling"])
def test_extra_state_without_scales_loads_silently(te_recipe, written):
    """TE's set_extra_state finds nothing to copy in these: nothing to restore, and no warning."""
    state = None if written.startswith("TE 2.0") else _stateless_records(te_recipe)[written]
    layer = te.Linear(16, 16)
    sd = layer.state_dict()
    sd["_extra_state"] = _te_extra_state(state) if state is not None else _pickled(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.load_state_dict(sd)
    assert layer.quantization_state() == {"forward": {}, "backward": {}}


@pytest.mark.parametrize("written", ["TE 2.0-2.3 None", "MXFP8BlockScaling", "TE 1.x io.BytesIO of None"])
def test_attention_extra_state_without_scales_loads_silently(te_recipe, written):
    """DotProductAttention has no use for FP8 attention scales and warns when a checkpoint holds
    some; the forms that hold none load silently."""
    if written.startswith("TE 2.0"):
        state = _pickled(None)
    elif written.startswith("TE 1.x"):
        state = io.BytesIO()
        torch.save(None, state)
    else:
        state = _te_extra_state(_stateless_records(te_recipe)[written])
    attention = te.DotProductAttention(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention.load_state_dict({"_extra_state": state})
    with pytest.warns(UserWarning, match="FP8 attention state is not used"):
        attention.load_state_dict({"_extra_state": _pickled(_te1x_state())})


@pytest.mark.parametrize("make, saved_gemms, counts", [
    (lambda: te.Linear(16, 16), 2, "num_gemms=2, 6 forward and 4 backward tensors, but this Linear has 1 GEMM, so 3 "
                                   "forward and 2 backward"),
    (lambda: te.GroupedLinear(2, 16, 16), 4, "num_gemms=4, 12 forward and 8 backward tensors, but this GroupedLinear "
                                             "has 2 GEMMs, so 6 forward and 4 backward"),
    (lambda: te.LayerNormMLP(16, 32), 1, "num_gemms=1, 3 forward and 2 backward tensors, but this LayerNormMLP has 2 "
                                         "GEMMs, so 6 forward and 4 backward"),
])
def test_state_of_another_gemm_count_restarts_with_a_warning_naming_both(te_recipe, make, saved_gemms, counts):
    module = make()
    sd = module.state_dict()
    sd["_extra_state"] = _te_extra_state(_delayed_state(te_recipe, saved_gemms))
    with pytest.warns(UserWarning, match=f"{type(module).__name__}: .*{counts}; it was saved from another module "
                                         "type .*restart.*drop its '_extra_state' entry") as record:
        module.load_state_dict(sd)
    assert len(record) == 1
    assert module.quantization_state() == {"forward": {}, "backward": {}}


def test_gemm_count_is_checked_where_num_gemms_is_not_recorded(te_recipe):
    state = _delayed_state(te_recipe, 2)
    del state["extra_fp8_variables"]
    layer = te.Linear(16, 16)
    sd = layer.state_dict()
    sd["_extra_state"] = _te_extra_state(state)
    with pytest.warns(UserWarning, match="holds FP8 scales for 6 forward and 4 backward tensors, but this Linear"):
        layer.load_state_dict(sd)
    assert layer.quantization_state() == {"forward": {}, "backward": {}}


def _te1x_state(history=16, seed=0) -> dict:
    """TE 1.x's extra state: no recipe, and scale_inv beside each scale."""
    g = torch.Generator().manual_seed(seed)
    return {"scale_fwd": torch.rand(3, generator=g) + 0.5, "scale_inv_fwd": torch.ones(3),
            "amax_history_fwd": torch.rand(history, 3, generator=g), "scale_bwd": torch.rand(2, generator=g) + 0.5,
            "scale_inv_bwd": torch.ones(2), "amax_history_bwd": torch.rand(history, 2, generator=g),
            "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 1}}


def _load_te1x(layer, state) -> None:
    sd = layer.state_dict()
    sd["_extra_state"] = _pickled(state)
    layer.load_state_dict(sd)


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID])
def test_te1x_state_takes_the_format_of_the_first_recipe(fmt):
    state = _te1x_state()
    layer = te.Linear(16, 16)
    _load_te1x(layer, state)
    torch.testing.assert_close(layer.quantization_state()["forward"]["weight"]["scale"], state["scale_fwd"][1:2])
    torch.testing.assert_close(layer.quantization_state()["backward"]["grad_output"]["scale"], state["scale_bwd"][:1])
    recipe = DelayedScaling(fp8_format=fmt, amax_history_len=16)
    with te.autocast(recipe=recipe):
        y = layer(torch.randn(4, 16))
    assert torch.isfinite(y).all()
    assert layer._recipe_state.recipe == recipe
    assert {r.value: g.fp8_dtype for r, g in layer._recipe_state.scaling_groups().items()} == {
        "input": fmt.forward_dtype, "weight": fmt.forward_dtype, "grad_output": fmt.backward_dtype}


def test_te1x_state_refuses_another_recipe_class():
    layer = te.Linear(32, 32)
    _load_te1x(layer, _te1x_state())
    with pytest.raises(ValueError, match="Linear: its FP8 scales were loaded from a Transformer Engine 1.x checkpoint.*"
                                         "the recipe is now MXFP8BlockScaling.*DelayedScaling recipe"):
        with te.autocast(recipe=MXFP8BlockScaling()):
            layer(torch.randn(32, 32))


def test_te1x_state_into_a_module_with_a_state_takes_its_format():
    layer = te.Linear(16, 16)
    recipe = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=16)
    with te.autocast(recipe=recipe):
        layer(torch.randn(4, 16))
    state = _te1x_state(seed=3)
    _load_te1x(layer, state)
    torch.testing.assert_close(layer.quantization_state()["forward"]["input"]["scale"], state["scale_fwd"][:1])
    with te.autocast(recipe=recipe):
        assert torch.isfinite(layer(torch.randn(4, 16))).all()


@pytest.mark.parametrize("state", [_te1x_state(), None], ids=["FP8 state", "no FP8"])
def test_te1x_bytesio_loads_as_the_uint8_form(state):
    """TE 1.x's default form, torch.save of its state in an io.BytesIO, is read with
    torch.load(weights_only=True): the scales load as from the uint8 form (a module that never
    ran FP8, None, loads silently)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    layer = te.Linear(16, 16)
    sd = layer.state_dict()
    sd["_extra_state"] = buffer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.load_state_dict(sd)
    if state is None:
        assert layer._recipe_state is None
        return
    torch.testing.assert_close(layer.quantization_state()["forward"]["weight"]["scale"], state["scale_fwd"][1:2])
    torch.testing.assert_close(layer.quantization_state()["backward"]["grad_output"]["scale"], state["scale_bwd"][:1])


def test_unreadable_bytesio_restarts_the_scales_with_a_warning():
    buffer = io.BytesIO(b"not an archive")
    layer = te.Linear(16, 16)
    sd = layer.state_dict()
    sd["_extra_state"] = buffer
    with pytest.warns(UserWarning, match="Transformer Engine extra state could not be read"):
        layer.load_state_dict(sd)


@pytest.mark.parametrize("make, prefix", [
    (lambda: te.MultiheadAttention(32, 4, qk_norm_type="L2Normalization"), ""),
    (lambda: te.TransformerLayer(32, 64, 4, qk_norm_type="L2Normalization"), "self_attention."),
])
def test_te_l2_normalization_extra_state_is_accepted(make, prefix):
    """TE's L2Normalization (q_norm and k_norm, one operation) writes an `_extra_state` entry."""
    module = make()
    sd = module.state_dict()
    for norm in ("q_norm", "k_norm"):
        sd[f"{prefix}{norm}._extra_state"] = torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module.load_state_dict(sd)  # strict: the entries are taken, not reported as unexpected
    sd[f"{prefix}q_norm._extra_state"] = torch.ones(3, dtype=torch.uint8)
    with pytest.warns(UserWarning, match="L2Normalization: the checkpoint's Transformer Engine extra state is not "
                                         "used"):
        module.load_state_dict(sd)


def test_l2_qk_norm_is_te_operation_with_te_state_dict_keys(stand_in):
    """TE's MultiheadAttention builds q_norm / k_norm as one ops.L2Normalization, a fusible operation
    with an `_extra_state`: the same type, eps and state-dict keys here; a te-core state dict of an
    earlier version, without those two entries, still loads strictly, to the same outputs."""
    te_pt = stand_in

    def make(seed):
        torch.manual_seed(seed)
        return te_pt.MultiheadAttention(32, 4, qk_norm_type="L2Normalization", qk_norm_eps=1e-4, attention_dropout=0.0)

    mha = make(0)
    assert isinstance(mha.q_norm, te_pt.ops.L2Normalization) and mha.q_norm is mha.k_norm and mha.q_norm.eps == 1e-4
    sd = mha.state_dict()
    te_keys = {"qkv.query_weight", "qkv.key_weight", "qkv.value_weight", "qkv.query_bias", "qkv.key_bias",
               "qkv.value_bias", "qkv._extra_state", "core_attention._extra_state", "proj.weight", "proj.bias",
               "proj._extra_state", "q_norm._extra_state", "k_norm._extra_state"}
    assert set(sd) == te_keys
    for norm in ("q_norm", "k_norm"):
        assert sd[f"{norm}._extra_state"].dtype == torch.uint8 and sd[f"{norm}._extra_state"].numel() == 0
    earlier = {k: v for k, v in sd.items() if not k.endswith("norm._extra_state")}
    fresh = make(1)
    x = torch.randn(5, 2, 32)
    assert not torch.equal(fresh(x), mha(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(earlier)  # strict
    assert torch.equal(fresh(x), mha(x))


class _TENormOp(torch.nn.Module):
    """What TE's norms are to load_state_dict: fusible operations with an `_extra_state` entry."""

    def __init__(self, n=None, bias=False):
        super().__init__()
        if n is not None:
            self.weight = torch.nn.Parameter(torch.ones(n))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(n))
        self.loaded = None

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        self.loaded = state


def test_export_writes_te_norms_extra_state():
    model = torch.nn.Sequential(te.Linear(8, 8), te.RMSNorm(8), te.LayerNorm(8))
    exported = to_transformer_engine_state_dict(model)
    assert list(exported) == ["0.weight", "0.bias", "0._extra_state", "1.weight", "1._extra_state", "2.weight",
                              "2.bias", "2._extra_state"]
    te_like = torch.nn.Sequential(torch.nn.Linear(8, 8), _TENormOp(8), _TENormOp(8, bias=True))
    te_like[0].register_load_state_dict_pre_hook(lambda m, sd, prefix, *_: sd.pop(prefix + "_extra_state"))
    te_like.load_state_dict(exported)  # strict, as TE's modules load
    assert te_like[1].loaded.dtype == torch.uint8 and te_like[1].loaded.numel() == 0


@pytest.mark.parametrize("kw, norms", [
    (dict(qk_norm_type="L2Normalization", output_layernorm=True),
     ["self_attention.q_norm", "self_attention.k_norm", "layernorm"]),
    (dict(qk_norm_type="RMSNorm"), ["self_attention.q_norm", "self_attention.k_norm"]),
])
def test_export_of_a_transformer_layer_has_te_norm_keys_and_loads_back(kw, norms):
    layer = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, **kw)
    exported = to_transformer_engine_state_dict(layer)
    for norm in norms:
        extra = exported[f"{norm}._extra_state"]
        assert extra.dtype == torch.uint8 and extra.numel() == 0
    fresh = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(exported)
    x = torch.randn(5, 2, 32)
    torch.testing.assert_close(fresh(x), layer(x))


# --- FP8 primary weights pickled by Transformer Engine (>= 2.16)

_F8_MODULE = "transformer_engine.pytorch.tensor.float8_tensor"


def _te_float8_checkpoint(monkeypatch, args, dtype_module: str) -> bytes:
    """torch.save of a state dict whose weight pickles as TE's Float8Tensor does: a call of
    `_make_float8_tensor_in_reduce_ex(*args)` with TE's DType (an IntEnum pickled as DType(7))
    from `dtype_module`, written with TE's module paths in place of the stand-in's."""
    with monkeypatch.context() as m:
        mods = {}
        for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.tensor",
                     _F8_MODULE, dtype_module):
            mods[name] = types.ModuleType(name)
            m.setitem(sys.modules, name, mods[name])

        class DType(enum.IntEnum):
            kFloat32 = 4
            kFloat8E4M3 = 7
            kFloat8E5M2 = 8

            def __reduce_ex__(self, protocol):  # DType(7) on every Python (some 3.11 releases pickle
                return type(self), (int(self),)  # an enum member as getattr(cls, name))

        def _make_float8_tensor_in_reduce_ex(*_):
            raise AssertionError("only TE's name is pickled")

        for obj, module in ((DType, dtype_module), (_make_float8_tensor_in_reduce_ex, _F8_MODULE)):
            obj.__module__, obj.__qualname__ = module, obj.__name__
            setattr(mods[module], obj.__name__, obj)

        class TEFloat8Weight:
            def __reduce_ex__(self, protocol):
                data, fp8_dtype, *rest = args
                return _make_float8_tensor_in_reduce_ex, (data, DType(fp8_dtype), *rest)

        buffer = io.BytesIO()
        torch.save({"weight": TEFloat8Weight(), "bias": torch.zeros(16, dtype=torch.bfloat16),
                    "_extra_state": torch.empty(0, dtype=torch.uint8)}, buffer)
    return buffer.getvalue()


def _fp8_weight(shape=(16, 16), seed=0):
    """(uint8 data, scale_inv, its value): an E4M3 weight quantized as TE stores it."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    scale = 448 / w.abs().max()
    fp8 = (w * scale).to(torch.float8_e4m3fn)
    scale_inv = (1 / scale).reshape(1)
    return fp8.view(torch.uint8), scale_inv, (fp8.float() * scale_inv).to(torch.bfloat16)


@pytest.mark.parametrize("dtype_module", ["transformer_engine.pytorch.constants", "transformer_engine_torch"])
@pytest.mark.parametrize("weights_only", [True, False])
def test_te_float8_weight_loads_into_a_linear(stand_in, monkeypatch, dtype_module, weights_only):
    data, scale_inv, value = _fp8_weight()
    blob = _te_float8_checkpoint(monkeypatch, (data, 7, scale_inv, torch.bfloat16, torch.Size([16, 16]), None),
                                 dtype_module)
    sd = torch.load(io.BytesIO(blob), weights_only=weights_only)
    assert type(sd["weight"]) is torch.Tensor and sd["weight"].dtype == torch.bfloat16
    assert torch.equal(sd["weight"], value)
    layer = stand_in.Linear(16, 16)
    layer.load_state_dict(sd)
    assert torch.equal(layer.weight.detach(), value.float())


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_te_float8_weight_loads_into_an_fp8_primary_weight(stand_in, monkeypatch, recipe):
    data, scale_inv, value = _fp8_weight(seed=1)
    blob = _te_float8_checkpoint(monkeypatch, (data, 7, scale_inv, torch.bfloat16, torch.Size([16, 16]), None),
                                 "transformer_engine.pytorch.constants")
    with stand_in.quantized_model_init(recipe=recipe):
        layer = stand_in.Linear(16, 16, params_dtype=torch.bfloat16)
    layer.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
    assert isinstance(layer.weight, stand_in.Float8Tensor)
    # requantized from the saved values with a scale of its own: within E4M3's rounding of them
    torch.testing.assert_close(layer.weight.dequantize().float(), value.float(), rtol=2 ** -4, atol=1e-6)


def test_te_float8_weight_kept_column_wise_only(stand_in, monkeypatch):
    """Where TE kept only the column-wise copy ([last, *leading]) it pickles that."""
    data, scale_inv, value = _fp8_weight(shape=(2, 4, 8), seed=2)
    transpose = data.permute(2, 0, 1).contiguous()
    blob = _te_float8_checkpoint(monkeypatch, (None, 7, scale_inv, torch.bfloat16, torch.Size([2, 4, 8]), transpose),
                                 "transformer_engine_torch")
    assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True)["weight"], value)


def test_damaged_te_float8_weight_says_what_is_wrong(stand_in, monkeypatch):
    data, scale_inv, _ = _fp8_weight()
    blob = _te_float8_checkpoint(monkeypatch, (data, 7, scale_inv, torch.bfloat16, torch.Size([8, 32]), None),
                                 "transformer_engine_torch")
    with pytest.raises(Exception, match=r"Float8Tensor in the checkpoint: its FP8 data has shape \(16, 16\), but its "
                                        r"shape is recorded as \(8, 32\); the checkpoint is corrupt"):
        torch.load(io.BytesIO(blob), weights_only=False)
    blob = _te_float8_checkpoint(monkeypatch, (data, 4, scale_inv, torch.bfloat16, torch.Size([16, 16]), None),
                                 "transformer_engine_torch")
    with pytest.raises(Exception, match="fp8_dtype .* is not DType.kFloat8E4M3 or kFloat8E5M2"):
        torch.load(io.BytesIO(blob), weights_only=True)


def test_weights_only_names_leave_with_the_stand_in(stand_in, monkeypatch):
    data, scale_inv, _ = _fp8_weight()
    blob = _te_float8_checkpoint(monkeypatch, (data, 7, scale_inv, torch.bfloat16, torch.Size([16, 16]), None),
                                 "transformer_engine_torch")
    uninstall_transformer_engine()
    assert not any(isinstance(g, tuple) and g[1].startswith(("transformer_engine", "transformer_engine_torch"))
                   for g in torch.serialization.get_safe_globals())
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
        torch.load(io.BytesIO(blob), weights_only=True)
