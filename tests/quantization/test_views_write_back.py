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
