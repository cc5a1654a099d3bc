"""parameters_split on Linear / LayerNormLinear: named row blocks of the weight and bias, the
same results and gradients as the unsplit module holding their concatenation."""
import pytest
import torch

import te_core as te
from te_core import recipe
from te_core.quantization import autocast

from ._compare import randomize_

FP32 = dict(rtol=1.3e-6, atol=1e-5)
SPLIT = {"query_": 16, "key_": 32, "value_": 16}


def pair(cls, parameters_split, **kw):
    torch.manual_seed(0)
    whole = cls(32, 64, **kw)
    randomize_(whole, seed=2, std=0.3)
    split = cls(32, 64, parameters_split=parameters_split, **kw)
    state = dict(whole.state_dict())
    names = [n.rstrip("_") for n in parameters_split]
    sizes = list(parameters_split.values()) if isinstance(parameters_split, dict) else [64 // len(names)] * len(names)
    for suffix in ("weight", "bias"):
        if state.get(suffix) is not None:
            for n, part in zip(names, state.pop(suffix).split(sizes)):
                state[f"{n}_{suffix}"] = part
    split.load_state_dict(state)
    return whole, split, names, sizes


@pytest.mark.parametrize("cls, parameters_split, kw", [
    (te.Linear, SPLIT, {}), (te.LayerNormLinear, SPLIT, dict(normalization="RMSNorm")),
    (te.LayerNormLinear, ("q", "k", "v", "o"), dict(bias=False)),
])
def test_split_parameters_match_the_whole(cls, parameters_split, kw):
    whole, split, names, sizes = pair(cls, parameters_split, **kw)
    assert "weight" not in dict(split.named_parameters())
    assert {f"{n}_weight" for n in names} <= set(dict(split.named_parameters()))
    x = torch.randn(3, 5, 32)
    xw, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    yw, ys = whole(xw), split(xs)
    torch.testing.assert_close(ys, yw, **FP32)
    dy = torch.randn(yw.shape)
    yw.backward(dy)
    ys.backward(dy)
    torch.testing.assert_close(xs.grad, xw.grad, **FP32)
    params = dict(split.named_parameters())
    for suffix in ("weight", "bias"):
        whole_p = getattr(whole, suffix)
        if whole_p is None:
            assert split.bias is None
            continue
        for n, g in zip(names, whole_p.grad.split(sizes)):
            torch.testing.assert_close(params[f"{n}_{suffix}"].grad, g, **FP32)


def test_split_linear_under_fp8():
    whole, split, _, _ = pair(te.Linear, SPLIT)
    x = torch.randn(32, 32)
    with autocast(recipe=recipe.DelayedScaling()):
        yw, ys = whole(x), split(x)
    torch.testing.assert_close(ys, yw, rtol=0.125, atol=0.0675)


def test_reset_parameters_writes_the_parts():
    mod = te.Linear(32, 64, parameters_split=SPLIT)
    with torch.no_grad():
        mod.query_bias.fill_(3.0)
        mod.key_weight.fill_(5.0)
    mod.reset_parameters()
    assert not mod.query_bias.any() and not (mod.key_weight == 5.0).any()


@pytest.mark.parametrize("parameters_split, error, match", [
    ({"q": 16, "k": 16}, ValueError, "sum to 32, but out_features=64"),
    (("a", "b", "c"), ValueError, "not divisible by 3"),
    ({"q_": 32, "q": 32}, ValueError, "repeat"),
    ({"q": 0, "k": 64}, ValueError, "positive row count"),
    ("qkv", TypeError, "must be a dict"),
])
def test_bad_parameters_split(parameters_split, error, match):
    with pytest.raises(error, match=match):
        te.Linear(32, 64, parameters_split=parameters_split)


def test_parameters_split_with_fused_wgrad_is_rejected():
    with pytest.raises(NotImplementedError, match="parameters_split with fuse_wgrad_accumulation"):
        te.LayerNormLinear(32, 64, parameters_split=SPLIT, fuse_wgrad_accumulation=True)
