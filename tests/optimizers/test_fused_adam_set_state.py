"""FusedAdam.set_scaled_state refuses a state of another shape than its parameter's with an error
naming both, rather than keeping it for the step to fail on; a state of the right shape is kept
as given (float32 master weights, read back exactly)."""
from __future__ import annotations

import pytest
import torch

from te_core.optimizers import FusedAdam


def test_set_scaled_state_takes_the_parameter_shape_only():
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4, 6).to(torch.bfloat16))
    optimizer = FusedAdam([param], lr=1e-3, master_weights=True)
    optimizer.initialize_state(param)
    master = torch.randn(4, 6)
    optimizer.set_scaled_state(param, "master_param", master)
    assert torch.equal(optimizer.get_unscaled_state(param, "master_param"), master)
    with pytest.raises(ValueError, match=r"master_param must have shape \(4, 6\), as the parameter it belongs to; "
                                         r"got \(2, 6\)"):
        optimizer.set_scaled_state(param, "master_param", torch.randn(2, 6))
    with pytest.raises(ValueError, match=r"exp_avg must have shape \(4, 6\).*got float"):
        optimizer.set_scaled_state(param, "exp_avg", 0.5)
    assert torch.equal(optimizer.get_unscaled_state(param, "master_param"), master)  # nothing half set
