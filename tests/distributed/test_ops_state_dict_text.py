"""te_core.distributed.state_dict's text form of extra state (what torch's distributed checkpoint
saves whole) loads into TE's fusible operations: an operation without quantization state gets its
empty entry as text too, and takes it back."""
from __future__ import annotations

import torch

from te_core.distributed.state_dict import get_model_state_dict, set_model_state_dict
from te_core.modules import fusible_ops as ops
from te_core.recipe import DelayedScaling
import te_core as te


def _model(seed: int):
    torch.manual_seed(seed)
    return ops.Sequential(ops.Linear(16, 24), ops.GELU(), ops.BasicLinear(24, 8))


def test_fusible_operations_load_their_text_extra_state():
    source, target = _model(0), _model(1)
    x = torch.randn(4, 16)
    with te.autocast(recipe=DelayedScaling()):
        source(x).sum().backward()
    state = get_model_state_dict(source)
    assert any(isinstance(v, str) and k.endswith("_extra_state") for k, v in state.items())
    set_model_state_dict(target, state)
    with te.autocast(recipe=DelayedScaling()):
        expected, got = source(x), target(x)
    # the same parameters and scaling state give the same FP8 step, bit for bit; and it is the
    # float64 layer within E4M3's tolerance
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with torch.no_grad():
        w1, b1 = source[0].weight.double(), source[0].bias.double()
        h = torch.nn.functional.gelu(x.double() @ w1.t() + b1, approximate="tanh")
        reference = h @ source[2].weight.double().t()
    torch.testing.assert_close(got.double(), reference, rtol=0.125, atol=0.0675)
