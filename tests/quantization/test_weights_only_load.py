"""torch.load(weights_only=True), torch's default, loads te-core's quantized tensors: each kind alone,
in a dict, as a parameter, and a quantized_model_init model's weights, with the same class, bytes,
scales, layouts and value (no quantizer: its bytes are never unpickled there), while a trusted
load keeps the quantizer, and a module pickled whole keeps sharing its own."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import te_core as te
from te_core import recipe
from te_core.dtype import DType
from te_core.quantization import QuantizedTensor
from te_core.quantization import tensor_pickle
from te_core.quantization.gemm import quantized_gemm

from .conftest import randn

E4M3, E5M2 = DType.kFloat8E4M3, DType.kFloat8E5M2

QUANTIZERS = {
    "delayed": lambda: te.Float8Quantizer(torch.tensor([2.0]), torch.zeros(1), E4M3),
    "current": lambda: te.Float8CurrentScalingQuantizer(E5M2),
    "block1d": lambda: te.Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=1),
    "block2d": lambda: te.Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=2),
    "mxfp8": lambda: te.MXFP8Quantizer(E4M3),
    "identity": lambda: te.IdentityQuantizer(),
    "hybrid": lambda: te.HybridQuantizer(rowwise_quantizer=te.Float8CurrentScalingQuantizer(E4M3),
                                         columnwise_quantizer=te.IdentityQuantizer()),
}


def _loaded(obj, weights_only=True):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=weights_only)


def _parts(t):
    """Every tensor a quantized tensor holds, by attribute name (a hybrid's directions' too), FP8 as bytes."""
    out = {}
    for name, value in vars(t).items():
        if name == "_quantizer":
            continue
        if isinstance(value, QuantizedTensor):
            out.update({f"{name}.{k}": v for k, v in _parts(value).items()})
        elif isinstance(value, torch.Tensor) or value is None:
            out[name] = value if value is None or value.element_size() != 1 else value.view(torch.uint8)
    return out


def assert_same(got, want):
    assert type(got) is type(want)
    assert (got.shape, got.dtype, got.stride(), got.device) == (want.shape, want.dtype, want.stride(), want.device)
    assert got.has_columnwise == want.has_columnwise
    got_parts, want_parts = _parts(got), _parts(want)
    assert got_parts.keys() == want_parts.keys()
    for name, value in want_parts.items():  # data, scale_inv, transpose / column-wise data present alike
        other = got_parts[name]
        assert (other is None) == (value is None), name
        if value is not None:
            assert other.dtype == value.dtype and other.stride() == value.stride() and torch.equal(other, value), name
    assert torch.equal(got.dequantize(), want.dequantize())


def _gemm(w, kind, gen):
    """x @ w.T through quantized_gemm, x cast by a quantizer of the kind's input (fresh inputs)."""
    x_kind = {"current": "delayed", "block2d": "block1d"}.get(kind, kind)  # (E4M3; 1x128 blocks)
    x = QUANTIZERS[x_kind]()(randn(gen, 32, w.shape[-1]))
    return quantized_gemm(x, w, out_dtype=torch.float32, gemm="fprop")


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_each_kind_loads_with_weights_only(kind, gen):
    value = randn(gen, 128, 128, scale=3.0)
    t = QUANTIZERS[kind]()(value)
    tol = {} if kind == "identity" else dict(rtol=0.125, atol=0.0675 * 3) if kind != "current" else \
        dict(rtol=0.25, atol=0.125 * 3)
    torch.testing.assert_close(t.dequantize().double(), value.double(), **tol)  # (a real cast of a real value)
    got = _loaded(t)
    assert_same(got, t)
    assert got.quantizer is None  # dropped: its pickle is never read by a weights_only load
    seed = torch.Generator().manual_seed
    assert torch.equal(_gemm(got, kind, seed(1)), _gemm(t, kind, seed(1)))
    if kind != "hybrid":
        # kept only column-wise (what a backward saves) and, for Float8Tensor, a view: still the same
        assert_same(_loaded(t.columnwise_only()), t.columnwise_only())
    if kind in ("delayed", "current"):
        assert_same(_loaded(t[8:40]), t[8:40])
        assert_same(_loaded(t.t()), t.t())


@pytest.mark.parametrize("kind", ["delayed", "block2d", "mxfp8", "identity"])
def test_parameters_in_a_dict_load_with_weights_only(kind, gen):
    weight = torch.nn.Parameter(QUANTIZERS[kind]()(randn(gen, 64, 128)))
    weight.tensor_model_parallel, weight.partition_dim = True, 1
    frozen = torch.nn.Parameter(QUANTIZERS[kind]()(randn(gen, 32, 64)), requires_grad=False)
    plain = randn(gen, 16)
    got = _loaded({"weight": weight, "frozen": frozen, "bias": plain, "step": 3})
    assert_same(got["weight"], weight)
    assert_same(got["frozen"], frozen)
    assert torch.equal(got["bias"], plain) and got["step"] == 3
    assert isinstance(got["weight"], torch.nn.Parameter) and got["weight"].requires_grad
    assert isinstance(got["frozen"], torch.nn.Parameter) and not got["frozen"].requires_grad
    assert (got["weight"].tensor_model_parallel, got["weight"].partition_dim) == (True, 1)


RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
           "block": recipe.Float8BlockScaling, "mxfp8": recipe.MXFP8BlockScaling}


@pytest.mark.parametrize("rec_name", list(RECIPES))
def test_quantized_model_init_weights_load_with_weights_only(rec_name, gen):
    rec = RECIPES[rec_name]()
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=rec, preserve_high_precision_init_val=True):
        module = te.Linear(128, 64)
    weight = module.weight
    assert isinstance(weight, QuantizedTensor)
    got = _loaded(weight)
    assert_same(got, weight)
    assert isinstance(got, torch.nn.Parameter) and got.requires_grad
    assert torch.equal(got.get_high_precision_init_val(), weight.get_high_precision_init_val())
    params = _loaded(dict(module.named_parameters()))
    assert_same(params["weight"], weight) and torch.equal(params["bias"], module.bias)
    state = _loaded(module.state_dict())  # (dequantized weights: loadable before too)
    fresh = te.Linear(128, 64)
    fresh.load_state_dict(state)
    x = randn(gen, 32, 128)
    with te.autocast(recipe=rec):
        want = module(x)
    with te.autocast(recipe=rec):
        assert torch.equal(fresh(x), want)
    # a trusted load of the module whole: its weight shares the quantizer its scaling state holds
    whole = _loaded(module, weights_only=False)
    state = whole._state_for(whole._fp8_init[0])
    assert whole.weight._quantizer is state.quantizer(whole._fp8_primary["weight"])
    assert_same(whole.weight, weight)


@pytest.mark.parametrize("kind", ["delayed", "block2d", "hybrid"])
def test_trusted_loads_keep_the_quantizer(kind, gen):
    t = QUANTIZERS[kind]()(randn(gen, 128, 128))
    for got in (_loaded(t, weights_only=False), pickle.loads(pickle.dumps(t)), copy.copy(t)):
        assert_same(got, t)
        assert type(got.quantizer) is type(t.quantizer)
        new = randn(gen, 128, 128, scale=2.0)
        got.copy_(new)  # requantized with its quantizer
        assert torch.equal(got.dequantize(), t.quantizer(new).dequantize())


def test_earlier_pickles_still_load(gen, monkeypatch):
    """te-core's earlier form (torch's subclass pickling with the tensor's __dict__) loads as before."""
    t = QUANTIZERS["current"]()(randn(gen, 64, 64))
    monkeypatch.setattr(QuantizedTensor, "__reduce_ex__", torch.Tensor.__reduce_ex__)
    buffer = io.BytesIO()
    torch.save(t, buffer)
    monkeypatch.undo()
    buffer.seek(0)
    got = torch.load(buffer, weights_only=False)
    assert_same(got, t) and type(got.quantizer) is type(t.quantizer)


_RAN = []


def _ran():
    _RAN.append(True)


class _Runs:
    def __reduce__(self):
        return _ran, ()


def test_weights_only_never_reads_the_quantizer_bytes(gen):
    t = QUANTIZERS["current"]()(randn(gen, 64, 64))
    rebuild, args, *rest = tensor_pickle.reduce(t, 2)
    blob = io.BytesIO()
    torch.save(_Runs(), blob)

    class Planted:  # a pickle whose quantizer bytes would run code when unpickled
        def __reduce__(self):
            return rebuild, (*args[:-1], blob.getvalue())

    got = _loaded(Planted())
    assert not _RAN and got.quantizer is None
    assert torch.equal(got.dequantize(), t.dequantize())


def test_malformed_pickles_are_refused(gen):
    t = QUANTIZERS["current"]()(randn(gen, 64, 64))
    _, args, *_ = tensor_pickle.reduce(t, 2)
    with pytest.raises(pickle.UnpicklingError, match="not one of te-core's quantized tensor kinds"):
        tensor_pickle.rebuild_checked("Tensor", *args[1:])
    with pytest.raises(pickle.UnpicklingError, match="holds"):
        tensor_pickle.rebuild_checked(args[0], *args[1:5], {"_data": args[5]["_data"]}, *args[6:])
    with pytest.raises(pickle.UnpicklingError, match="attribute '_quantizer'"):
        tensor_pickle.rebuild_checked(*args[:8], {"_quantizer": 1}, None)
    with pytest.raises(pickle.UnpicklingError, match="attribute 'dequantize'"):
        tensor_pickle.rebuild_checked(*args[:8], {"dequantize": 1}, None)
    assert isinstance(tensor_pickle.rebuild_checked(*args), type(t))
