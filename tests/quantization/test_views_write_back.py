"""An in-place write through a view of an FP8 primary weight that its format cannot hold
quantized (a reshape or flattening of block-scaled or MXFP8 data, a split or chunk of MXFP8 rows)
reaches the weight, as it reaches a plain tensor: these views are DequantizedViews, which write
back; a dequantized copy read right but dropped the write without an error."""
import pytest
import torch

import te_core as te
from te_core import recipe

RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
           "block": recipe.Float8BlockScaling, "mxfp8": recipe.MXFP8BlockScaling}
WRITES = {
    "view": lambda w: w.view(256, 128).mul_(-1),
    "split": lambda w: w.split(64)[1].zero_(),
    "chunk": lambda w: w.chunk(2)[0].mul_(-0.5),
    "unbind": lambda w: w.unbind(0)[3].mul_(-1),
}
SAME_WRITE = {
    "view": lambda v: v.view(256, 128).mul_(-1),
    "split": lambda v: v.split(64)[1].zero_(),
    "chunk": lambda v: v.chunk(2)[0].mul_(-0.5),
    "unbind": lambda v: v.unbind(0)[3].mul_(-1),
}


@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize("name", list(RECIPES))
def test_a_write_through_a_view_reaches_the_weight(name, write):
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=RECIPES[name]()):
        weight = te.Linear(256, 128).weight
    expected = weight.dequantize().clone()
    with torch.no_grad():
        SAME_WRITE[write](expected)
        WRITES[write](weight)
    # the weight holds the written value requantized (within one FP8 step of it); a dropped
    # write (signs flipped, rows zeroed or halved) is far outside that
    scale = expected.abs().max()
    torch.testing.assert_close(weight.dequantize() / scale, expected / scale, rtol=0.125, atol=0.0675)


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_a_whole_fp8_weight_copied_from_another_takes_its_bytes_and_scale(name):
    """copy_ of one tensor-wise FP8 weight into another with another scale (a delayed scale
    from other values) is exact, as Transformer Engine's copy_ is, and so is a load of another
    model's FP8 state dict (state_dict(keep_vars=True)): requantizing with the destination's
    scale rounded every value again, and saturated a source four times larger."""
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=RECIPES[name]()):
        source, target = te.Linear(256, 128), te.Linear(256, 128)
    with torch.no_grad():
        source.weight.copy_(source.weight.dequantize() * 4)
        target.weight.copy_(source.weight)
    assert torch.equal(target.weight.dequantize(), source.weight.dequantize())
    assert torch.equal(target.weight._scale_inv, source.weight._scale_inv)
    with te.quantized_model_init(recipe=RECIPES[name]()):
        fresh = te.Linear(256, 128)
    fresh.load_state_dict(source.state_dict(keep_vars=True))
    assert torch.equal(fresh.weight.dequantize(), source.weight.dequantize())


@pytest.mark.parametrize("name", list(RECIPES))
def test_an_op_writing_out_into_an_fp8_weight_reaches_it(name):
    """torch ops given an FP8 weight as `out=` write their result into it (requantized, as an
    in-place op's), and return it: the write went to a temporary copy and was lost."""
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=RECIPES[name]()):
        weight = te.Linear(256, 128).weight
    source = weight.dequantize().clone()
    with torch.no_grad():
        returned = torch.mul(source, -1.0, out=weight)
    assert returned is weight
    scale = source.abs().max()
    torch.testing.assert_close(weight.dequantize() / scale, -source / scale, rtol=0.125, atol=0.0675)
