"""quantized_model_init(preserve_high_precision_init_val=True): each FP8 primary weight keeps its
value from before quantization on the CPU, under Transformer Engine's get / clear methods
(what Megatron-LM's distributed optimizer seeds its master weights from)."""
import copy
import io
import warnings

import pytest
import torch

import te_core as te
from te_core import recipe
from te_core.quantization import QuantizedTensor

RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
           "block": recipe.Float8BlockScaling}
MODULES = {  # module, names of its FP8 primary weights
    "Linear": (lambda: te.Linear(64, 32), ("weight",)),
    "LayerNormLinear": (lambda: te.LayerNormLinear(64, 32), ("weight",)),
    "LayerNormMLP": (lambda: te.LayerNormMLP(64, 128), ("fc1_weight", "fc2_weight")),
    "GroupedLinear": (lambda: te.GroupedLinear(2, 64, 32), ("weight0", "weight1")),
}


def _built(name, rec=None, preserve=True, seed=0):
    make, _ = MODULES[name]
    torch.manual_seed(seed)
    if rec is None:
        return make()
    with te.quantized_model_init(recipe=rec, preserve_high_precision_init_val=preserve):
        return make()


@pytest.mark.parametrize("rec_name", sorted(RECIPES))
@pytest.mark.parametrize("name", sorted(MODULES))
def test_each_fp8_weight_keeps_its_initial_value_on_the_cpu(name, rec_name):
    module = _built(name, RECIPES[rec_name]())
    plain = _built(name)  # the same seed without FP8: the initializer's values
    for weight_name in MODULES[name][1]:
        weight = getattr(module, weight_name)
        assert isinstance(weight, QuantizedTensor)
        kept = weight.get_high_precision_init_val()
        expected = getattr(plain, weight_name).detach().cpu()
        assert kept.device.type == "cpu" and kept.dtype == expected.dtype
        assert torch.equal(kept, expected)
        # the FP8 weight is that value rounded (E4M3 tolerances), not another draw
        torch.testing.assert_close(weight.dequantize(kept.dtype).cpu(), kept, rtol=0.125, atol=0.0675)


@pytest.mark.parametrize("rec_name", sorted(RECIPES) + ["mxfp8"])
@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP"])
def test_transformer_engines_quantizer_of_a_weight_requantizes_it_exactly(name, rec_name):
    """TE's test_sanity: weight._get_quantizer().make_empty(...), then update_quantized(the kept
    high-precision value, that tensor) gives the weight's own FP8 values bit for bit; the
    quantizer has TE's interface and the weight's layouts."""
    rec = RECIPES[rec_name]() if rec_name != "mxfp8" else recipe.MXFP8BlockScaling()
    module = _built(name, rec)
    for weight_name in MODULES[name][1]:
        weight = getattr(module, weight_name)
        q = weight._get_quantizer()
        assert q.get_usages() == {"rowwise": True, "columnwise": weight.has_columnwise}
        fresh = q.make_empty(shape=weight.shape, dtype=weight.dtype, device=weight.device)
        q.update_quantized(weight.get_high_precision_init_val().to(weight.device), fresh)
        assert type(fresh) is type(weight)
        assert torch.equal(fresh.dequantize(dtype=weight.dtype), weight.dequantize(dtype=weight.dtype)), weight_name
        for key, t in weight._payload().items():  # the FP8 bytes and scales themselves
            if t is not None:
                got = getattr(fresh, key)
                if t.element_size() == 1:
                    got, t = got.view(torch.uint8), t.view(torch.uint8)
                assert torch.equal(got, t), (weight_name, key)


def test_clearing_frees_the_value_and_keeps_the_methods():
    module = _built("LayerNormMLP", recipe.DelayedScaling())
    first, second = module.fc1_weight, module.fc2_weight
    first.clear_high_precision_init_val()
    assert first.get_high_precision_init_val() is None and hasattr(first, "clear_high_precision_init_val")
    assert second.get_high_precision_init_val() is not None  # each weight its own


def test_without_preserving_no_weight_has_the_methods():
    for module in (_built("Linear", recipe.DelayedScaling(), preserve=False), _built("Linear")):
        assert not hasattr(module.weight, "get_high_precision_init_val")
        assert not hasattr(module.weight, "clear_high_precision_init_val")
    with te.quantized_model_init(enabled=False, preserve_high_precision_init_val=True):
        assert not hasattr(te.Linear(64, 32).weight, "get_high_precision_init_val")
    weight = _built("Linear", recipe.DelayedScaling(), preserve=False).weight
    with pytest.raises(AttributeError, match="preserve_high_precision_init_val=True"):
        weight.get_high_precision_init_val()


def test_the_innermost_context_decides():
    with te.quantized_model_init(recipe=recipe.DelayedScaling(), preserve_high_precision_init_val=True):
        kept = te.Linear(64, 32)
        with te.quantized_model_init(recipe=recipe.DelayedScaling()):
            not_kept = te.Linear(64, 32)
    assert hasattr(kept.weight, "get_high_precision_init_val")
    assert not hasattr(not_kept.weight, "get_high_precision_init_val")


def test_saved_loaded_and_copied_models_keep_the_value():
    module = _built("LayerNormMLP", recipe.Float8CurrentScaling())
    kept = module.fc1_weight.get_high_precision_init_val()
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(module)
    converted = copy.deepcopy(module).to(torch.float16)  # another nominal dtype, the same FP8 data
    assert torch.equal(converted.fc1_weight.get_high_precision_init_val(), kept)
    for twin in (loaded, copied):
        value = twin.fc1_weight.get_high_precision_init_val()
        assert torch.equal(value, kept) and value.data_ptr() != kept.data_ptr()
        twin.fc1_weight.clear_high_precision_init_val()  # a copy's clear leaves the original alone
    assert torch.equal(module.fc1_weight.get_high_precision_init_val(), kept)
    module.fc2_weight.clear_high_precision_init_val()
    cleared_copy = copy.deepcopy(module).fc2_weight
    assert hasattr(cleared_copy, "get_high_precision_init_val") and cleared_copy.get_high_precision_init_val() is None


def test_fp8_model_init_passes_it_on_and_a_non_bool_is_refused():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with te.fp8_model_init(recipe=recipe.DelayedScaling(), preserve_high_precision_init_val=True):
            module = te.Linear(64, 32)
    assert module.weight.get_high_precision_init_val() is not None
    with pytest.raises(TypeError, match="preserve_high_precision_init_val must be True or False"):
        with te.quantized_model_init(recipe=recipe.DelayedScaling(), preserve_high_precision_init_val="yes"):
            pass


def test_a_meta_device_module_keeps_its_value_at_reset_parameters():
    """A weight made on the meta device has no value yet: it gets the methods when
    reset_parameters() initializes it (Transformer Engine's deferred initialization), keeping the
    value a module built directly under the same seed keeps (tests/modules/test_meta_init.py)."""
    with te.quantized_model_init(recipe=recipe.DelayedScaling(), preserve_high_precision_init_val=True):
        module = te.LayerNormMLP(64, 128, device="meta")
    assert isinstance(module.fc1_weight, QuantizedTensor) and not hasattr(module.fc1_weight,
                                                                          "get_high_precision_init_val")
    torch.manual_seed(0)
    module.reset_parameters()
    direct = _built("LayerNormMLP", recipe.DelayedScaling())
    for name in ("fc1_weight", "fc2_weight"):
        kept = getattr(module, name).get_high_precision_init_val()
        assert kept.device.type == "cpu" and torch.equal(kept, getattr(direct, name).get_high_precision_init_val())