"""State dicts written by Transformer Engine load into te-core modules: its separate q/k/v
names (fuse_qkv_params=False), its interleaved fused-QKV layout, and its pickled `_extra_state`
(read through an allow-list, never by unpickling arbitrary objects)."""
from __future__ import annotations

import collections
import dataclasses
import enum
import io
import pickle
import sys
import types
import warnings
from typing import NamedTuple

import pytest
import torch

import te_core as te
from te_core.recipe import DelayedScaling

TE_RECIPE = "transformer_engine.common.recipe"


def _fake_te_recipe_module():
    """Classes with Transformer Engine's module path, names and fields, so pickle writes the
    same global references and state TE's checkpoints hold."""
    mod = types.ModuleType(TE_RECIPE)

    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float

    class Format(enum.Enum):
        E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
        E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
        HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: str = "max"
        scaling_factor_compute_algo: object = None
        reduce_amax: bool = True
        fp8_dpa: bool = False
        fp8_mha: bool = False

    for cls in (_FormatHelper, Format, DelayedScaling):
        cls.__module__, cls.__qualname__ = TE_RECIPE, cls.__name__
        setattr(mod, cls.__name__, cls)
    return mod


@pytest.fixture
def te_recipe(monkeypatch):
    mod = _fake_te_recipe_module()
    for parent in ("transformer_engine", "transformer_engine.common"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, TE_RECIPE, mod)
    return mod


class _EnumPickler(pickle.Pickler):
    """Pickles enum members by value, or by name (getattr(cls, name)), as Python versions differ."""

    def __init__(self, file, enums: str):
        super().__init__(file)
        self.enums = enums

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return (getattr, (type(obj), obj.name)) if self.enums == "by name" else (type(obj), (obj.value,))
        return NotImplemented


def _te_extra_state(state, enums: str = "by value") -> torch.Tensor:
    """TE's serialization: the pickled dict as a uint8 tensor."""
    buffer = io.BytesIO()
    _EnumPickler(buffer, enums).dump(state)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _delayed_state(te_recipe, num_gemms, history=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    recipe = te_recipe.DelayedScaling(margin=1, fp8_format=te_recipe.Format.E4M3, amax_history_len=history)
    return {
        "recipe": recipe,
        "scale_fwd": torch.rand(3 * num_gemms, generator=g) + 0.5,
        "amax_history_fwd": torch.rand(history, 3 * num_gemms, generator=g) + 0.1,
        "scale_bwd": torch.rand(2 * num_gemms, generator=g) + 0.5,
        "amax_history_bwd": torch.rand(history, 2 * num_gemms, generator=g) + 0.1,
        "extra_fp8_variables": {"num_gemms": num_gemms, "fp8_checkpoint": True},
    }


@pytest.mark.parametrize("enums", ["by value", "by name"])
def test_linear_restores_te_delayed_scaling_state(te_recipe, enums):
    state = _delayed_state(te_recipe, 1)
    src = te.Linear(16, 16)
    layer = te.Linear(16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the state is read, not restarted with a warning
        layer.load_state_dict({"weight": src.weight.detach(), "bias": src.bias.detach(),
                               "_extra_state": _te_extra_state(state, enums)})
    got = layer.quantization_state()
    for slot, column in (("input", 0), ("weight", 1)):
        torch.testing.assert_close(got["forward"][slot]["scale"], state["scale_fwd"][column:column + 1])
        torch.testing.assert_close(got["forward"][slot]["amax_history"], state["amax_history_fwd"][:, column])
    torch.testing.assert_close(got["backward"]["grad_output"]["scale"], state["scale_bwd"][0:1])
    torch.testing.assert_close(got["backward"]["grad_output"]["amax_history"], state["amax_history_bwd"][:, 0])
    recipe = DelayedScaling(margin=1, fp8_format=te.recipe.Format.E4M3, amax_history_len=4)
    with te.autocast(recipe=recipe):  # the restored state serves the matching recipe
        y = layer(torch.randn(16, 16))
    assert torch.isfinite(y).all()


def test_megatron_recipe_subclass_is_read_as_delayed_scaling(te_recipe, monkeypatch):
    """Megatron-LM's checkpoints of TE models pickle its TEDelayedScaling (a DelayedScaling
    subclass): its state is read as TE's DelayedScaling."""
    meg = "megatron.core.extensions.transformer_engine"
    mod = types.ModuleType(meg)

    class TEDelayedScaling(te_recipe.DelayedScaling):
        pass

    TEDelayedScaling.__module__, TEDelayedScaling.__qualname__ = meg, "TEDelayedScaling"
    mod.TEDelayedScaling = TEDelayedScaling
    for parent in ("megatron", "megatron.core", "megatron.core.extensions"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, meg, mod)
    state = _delayed_state(te_recipe, 1, seed=2)
    state["recipe"] = TEDelayedScaling(margin=1, fp8_format=te_recipe.Format.E4M3, amax_history_len=4)
    layer = te.Linear(16, 16)
    sd = layer.state_dict()
    sd["_extra_state"] = _te_extra_state(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.load_state_dict(sd)
    torch.testing.assert_close(layer.quantization_state()["forward"]["weight"]["scale"], state["scale_fwd"][1:2])


def test_layernorm_mlp_maps_te_gemm_columns_to_fc1_and_fc2(te_recipe):
    state = _delayed_state(te_recipe, 2, seed=1)
    mlp = te.LayerNormMLP(16, 32)
    sd = mlp.state_dict()
    sd["_extra_state"] = _te_extra_state(state)
    mlp.load_state_dict(sd)
    got = mlp.quantization_state()
    expected = {("forward", "fc1_input"): state["scale_fwd"][0], ("forward", "fc1_weight"): state["scale_fwd"][1],
                ("forward", "fc2_input"): state["scale_fwd"][3], ("forward", "fc2_weight"): state["scale_fwd"][4],
                ("backward", "fc1_grad_output"): state["scale_bwd"][0],
                ("backward", "fc2_grad_output"): state["scale_bwd"][2]}
    for (direction, slot), value in expected.items():
        torch.testing.assert_close(got[direction][slot]["scale"], value.view(1))


def test_unreadable_extra_state_restarts_the_scales_with_one_warning(te_recipe):
    ran = []

    class Payload:
        def __reduce__(self):
            return (ran.append, ("executed",))

    layer = te.Linear(16, 16)
    sd = layer.state_dict()
    sd["_extra_state"] = torch.frombuffer(bytearray(pickle.dumps({"recipe": Payload()})), dtype=torch.uint8)
    with pytest.warns(UserWarning, match="could not be read .*restart") as record:
        layer.load_state_dict(sd)
    assert ran == [] and len([w for w in record if "could not be read" in str(w.message)]) == 1
    assert layer.quantization_state() == {"forward": {}, "backward": {}}


def test_getattr_in_extra_state_only_names_members_of_te_recipe_classes(te_recipe):
    """getattr is allowed for enum members pickled by name, on TE's recipe classes only."""

    class Lookup:
        def __reduce__(self):
            return (getattr, (collections.OrderedDict, "fromkeys"))

    layer = te.Linear(16, 16)
    sd = layer.state_dict()
    sd["_extra_state"] = torch.frombuffer(bytearray(pickle.dumps({"recipe": Lookup()})), dtype=torch.uint8)
    with pytest.warns(UserWarning, match="refusing getattr.*only members of TE's recipe classes"):
        layer.load_state_dict(sd)
    assert layer.quantization_state() == {"forward": {}, "backward": {}}


def test_empty_te_extra_state_loads_silently():
    layer = te.Linear(16, 16)
    sd = layer.state_dict()
    sd["_extra_state"] = torch.empty(0, dtype=torch.uint8)
    layer.load_state_dict(sd)
    assert layer.quantization_state() == {"forward": {}, "backward": {}}


def _fused_names(module):
    """te-core's own form of a state dict (one fused q/k/v weight), as checkpoints written before
    its state dicts took Transformer Engine's names hold it."""
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in module.state_dict(keep_vars=True).items()}


TE_SPLIT_NAMES = [f"{sub}.{part}_{kind}" for sub, parts in (
    ("self_attention.layernorm_qkv", ("query", "key", "value")), ("inter_attention.layernorm_query", ("query",)),
    ("inter_attention.key_value", ("key", "value"))) for kind in ("weight", "bias") for part in parts]


def test_transformer_layer_state_dict_has_te_split_qkv_names_with_gqa():
    torch.manual_seed(0)
    h, g, d = 4, 2, 8
    kw = dict(num_gqa_groups=g, layer_type="decoder", hidden_dropout=0.0, attention_dropout=0.0)
    src = te.TransformerLayer(32, 64, h, **kw)
    sd = src.state_dict()
    assert set(TE_SPLIT_NAMES) <= set(sd)
    assert not {"self_attention.layernorm_qkv.weight", "inter_attention.key_value.weight"} & set(sd)
    assert sd["self_attention.layernorm_qkv.key_weight"].shape == (g * d, 32)
    for part in ("query", "key", "value"):  # TE's parameter order: the weights, then the biases
        assert list(sd).index(f"self_attention.layernorm_qkv.{part}_weight") < list(sd).index(
            "self_attention.layernorm_qkv.query_bias")
    x, enc = torch.randn(5, 2, 32), torch.randn(6, 2, 32)
    for given in (sd, _fused_names(src)):  # TE's names and te-core's earlier fused ones both load
        dst = te.TransformerLayer(32, 64, h, **kw)
        dst.load_state_dict(given)  # (strict: a missing or unexpected key raises)
        torch.testing.assert_close(dst(x, encoder_output=enc), src(x, encoder_output=enc), rtol=1.3e-6, atol=1e-5)


def test_writing_te_split_names_writes_the_weights():
    """Transformer Engine's Hugging Face loading recipes copy q, k and v into the tensors of
    `model.state_dict()`: those must be the module's own weights."""
    torch.manual_seed(3)
    h, g, d = 4, 2, 8
    layer = te.TransformerLayer(32, 64, h, num_gqa_groups=g, hidden_dropout=0.0, attention_dropout=0.0)
    q, k, v = torch.randn(h * d, 32), torch.randn(g * d, 32), torch.randn(g * d, 32)
    kb = torch.randn(g * d)
    sd = layer.state_dict()
    sd["self_attention.layernorm_qkv.query_weight"].data[:] = q
    sd["self_attention.layernorm_qkv.key_weight"].data.copy_(k)
    sd["self_attention.layernorm_qkv.value_weight"].data[:] = v
    sd["self_attention.layernorm_qkv.key_bias"].data[:] = kb
    qkv = layer.self_attention.layernorm_qkv
    assert torch.equal(qkv.weight.detach(), torch.cat([q, k, v]))
    assert torch.equal(qkv.bias.detach()[h * d:h * d + g * d], kb)


def test_state_dict_keeps_fused_names_where_the_parts_cannot_be_views():
    """keep_vars=True returns the Parameters themselves, and fuse_qkv_params=True is TE's fused
    (interleaved) weight: both keep the one fused name."""
    layer = te.TransformerLayer(32, 64, 4)
    assert "self_attention.layernorm_qkv.weight" in layer.state_dict(keep_vars=True)
    assert isinstance(layer.state_dict(keep_vars=True)["self_attention.layernorm_qkv.weight"], torch.nn.Parameter)
    fused = te.TransformerLayer(32, 64, 4, fuse_qkv_params=True)
    sd = fused.state_dict()
    assert "self_attention.layernorm_qkv.weight" in sd and "self_attention.layernorm_qkv.query_weight" not in sd


def test_interleaved_fused_qkv_is_read_in_te_order():
    """A fused weight in TE's interleaved layout (per kv group: its q heads, k, v) gives the
    same attention as the same q, k, v weights given separately."""
    torch.manual_seed(1)
    h, g, d = 4, 2, 8
    plain = te.MultiheadAttention(32, h, num_gqa_groups=g, attention_dropout=0.0)
    q, k, v = plain.qkv.weight.detach().split([h * d, g * d, g * d])
    qb, kb, vb = plain.qkv.bias.detach().split([h * d, g * d, g * d])

    def interleave(qt, kt, vt):
        return torch.cat([qt.reshape(g, h // g * d, *qt.shape[1:]), kt.reshape(g, d, *kt.shape[1:]),
                          vt.reshape(g, d, *vt.shape[1:])], dim=1).reshape(-1, *qt.shape[1:])

    fused = te.MultiheadAttention(32, h, num_gqa_groups=g, attention_dropout=0.0, fuse_qkv_params=True)
    sd = plain.state_dict()
    sd["qkv.weight"], sd["qkv.bias"] = interleave(q, k, v), interleave(qb, kb, vb)
    fused.load_state_dict(sd)
    x = torch.randn(5, 2, 32)
    torch.testing.assert_close(fused(x), plain(x), rtol=1.3e-6, atol=1e-5)
    # the split names load into the interleaved module too, regrouped
    split = te.MultiheadAttention(32, h, num_gqa_groups=g, attention_dropout=0.0, fuse_qkv_params=True)
    sd = plain.state_dict()  # TE's names: query_weight, key_weight, ...
    assert "qkv.query_weight" in sd
    split.load_state_dict(sd)
    torch.testing.assert_close(split.qkv.weight, fused.qkv.weight)
    torch.testing.assert_close(split(x), plain(x), rtol=1.3e-6, atol=1e-5)


def test_te_core_checkpoints_keep_loading_with_weights_only():
    layer = te.TransformerLayer(32, 64, 4)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        layer(torch.randn(8, 2, 32)).sum().backward()
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert "self_attention.core_attention._extra_state" in sd
    fresh = te.TransformerLayer(32, 64, 4)
    fresh.load_state_dict(sd)
    torch.testing.assert_close(fresh.quantization_state()["forward"]["self_attention.layernorm_qkv.input"]["scale"],
                               layer.quantization_state()["forward"]["self_attention.layernorm_qkv.input"]["scale"])


def test_export_in_te_names_round_trips():
    from te_core.compat.te_state_dict_names import to_transformer_engine_state_dict

    torch.manual_seed(2)
    kw = dict(num_gqa_groups=2, layer_type="decoder", hidden_dropout=0.0, attention_dropout=0.0)
    src = te.TransformerLayer(32, 64, 4, **kw)
    exported = to_transformer_engine_state_dict(src)
    for name in ("self_attention.layernorm_qkv.query_weight", "self_attention.layernorm_qkv.value_bias",
                 "inter_attention.layernorm_query.query_weight", "inter_attention.key_value.key_weight"):
        assert name in exported
    assert "self_attention.layernorm_qkv.weight" not in exported
    assert exported["self_attention.core_attention._extra_state"].dtype == torch.uint8
    dst = te.TransformerLayer(32, 64, 4, **kw)
    dst.load_state_dict(exported)
    x, enc = torch.randn(5, 2, 32), torch.randn(6, 2, 32)
    torch.testing.assert_close(dst(x, encoder_output=enc), src(x, encoder_output=enc), rtol=1.3e-6, atol=1e-5)


def test_te_norm_extra_state_is_accepted():
    norm = te.LayerNorm(16)
    sd = norm.state_dict()
    sd["_extra_state"] = torch.empty(0, dtype=torch.uint8)
    norm.load_state_dict(sd)  # strict: the entry is taken, not reported as unexpected
    sd["_extra_state"] = torch.ones(3, dtype=torch.uint8)
    with pytest.warns(UserWarning, match="extra state is not used"):
        norm.load_state_dict(sd)


def test_te_part_names_read_as_views_and_dcp_state_dicts_round_trip(tmp_path):
    """`layernorm_qkv.query_weight` reads (and writes) the fused weight's rows, as TE's attribute
    does; torch.distributed.checkpoint's state-dict functions, which look every state-dict name
    up as an attribute, save and load the layer."""
    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch.manual_seed(4)
    h, g, d = 4, 2, 8
    src = te.TransformerLayer(32, 64, h, num_gqa_groups=g, hidden_dropout=0.0, attention_dropout=0.0)
    qkv = src.self_attention.layernorm_qkv
    assert torch.equal(qkv.key_weight, qkv.weight[h * d:(h + g) * d])
    assert torch.equal(qkv.value_bias, qkv.bias[(h + g) * d:])
    with torch.no_grad():
        qkv.value_weight.copy_(torch.randn(g * d, 32))
    assert torch.equal(qkv.weight[(h + g) * d:], qkv.value_weight)
    with pytest.raises(AttributeError):
        qkv.gate_weight  # noqa: B018 - not a part name
    dst = te.TransformerLayer(32, 64, h, num_gqa_groups=g, hidden_dropout=0.0, attention_dropout=0.0)
    set_model_state_dict(dst, get_model_state_dict(src))
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's note that no process group is initialized
        save(get_model_state_dict(src), checkpoint_id=str(tmp_path))
        fresh = te.TransformerLayer(32, 64, h, num_gqa_groups=g, hidden_dropout=0.0, attention_dropout=0.0)
        state = get_model_state_dict(fresh)
        load(state, checkpoint_id=str(tmp_path))  # into the views, i.e. the fused parameters
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), fresh.parameters()))
