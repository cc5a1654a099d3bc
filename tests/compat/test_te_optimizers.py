"""transformer_engine.pytorch.optimizers under the stand-in: Transformer Engine's names there
resolve to te-core's (its files fused_adam, fused_sgd and multi_tensor_apply too), and its
kernel-only names say that te-core does not provide them and which optimizer to step with."""
from __future__ import annotations

import importlib

import pytest
import torch

from te_core import optimizers

PROVIDED = ["FusedAdam", "FusedSGD", "MultiTensorApply", "multi_tensor_applier", "multi_tensor_scale",
            "multi_tensor_scale_tensor", "multi_tensor_l2norm", "multi_tensor_unscale_l2norm"]


def test_te_optimizer_names_resolve_to_te_core(stand_in):
    te_optimizers = importlib.import_module("transformer_engine.pytorch.optimizers")
    for name in PROVIDED:
        assert getattr(te_optimizers, name) is getattr(optimizers, name), name
    from transformer_engine.pytorch.optimizers.fused_adam import FusedAdam
    from transformer_engine.pytorch.optimizers.fused_sgd import FusedSGD
    from transformer_engine.pytorch.optimizers.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

    assert (FusedAdam, FusedSGD, MultiTensorApply) == (optimizers.FusedAdam, optimizers.FusedSGD,
                                                       optimizers.MultiTensorApply)
    assert multi_tensor_applier is optimizers.multi_tensor_applier and stand_in.optimizers is te_optimizers


@pytest.mark.parametrize("name, optimizer", [
    ("multi_tensor_adam", "FusedAdam"), ("multi_tensor_adam_fp8", "FusedAdam"),
    ("multi_tensor_adam_capturable", "FusedAdam"), ("multi_tensor_adam_capturable_master", "FusedAdam"),
    ("multi_tensor_sgd", "FusedSGD"),
])
def test_a_kernel_name_says_te_core_does_not_provide_it(stand_in, name, optimizer):
    import transformer_engine.pytorch.optimizers as te_optimizers

    full = f"transformer_engine.pytorch.optimizers.{name}"
    with pytest.raises(ImportError, match=rf"cannot import name '{name}' from 'transformer_engine.pytorch.optimizers': "
                                          rf"te-core stands in for Transformer Engine here and does not provide "
                                          rf"'{full}' \(a kernel of Transformer Engine's extension, which its "
                                          rf"{optimizer} launches: step with transformer_engine.pytorch.optimizers."
                                          rf"{optimizer}"):
        exec(f"from transformer_engine.pytorch.optimizers import {name}")
    assert not hasattr(te_optimizers, name)  # integrations probe with hasattr


def test_te_style_gradient_clipping_through_the_stand_in(stand_in):
    """Megatron-LM's clipping: the norm of the (loss-scaled) gradients, then [grads, grads]
    scaled in place by max_norm / norm, against a float64 computation."""
    from transformer_engine.pytorch.optimizers import (MultiTensorApply, multi_tensor_scale,
                                                       multi_tensor_unscale_l2norm)

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g).to(d) * 64 for s, d in (((9, 4), torch.float32), ((33,), torch.bfloat16))]
    want = [t.double() / 64 for t in grads]
    applier, flag = MultiTensorApply(2048 * 32), torch.zeros(1, dtype=torch.int)
    norm, _ = applier(multi_tensor_unscale_l2norm, flag, [grads], torch.tensor([1 / 64]))
    want_norm = torch.cat([t.flatten() for t in want]).norm()
    torch.testing.assert_close(norm.double(), want_norm.reshape(1), rtol=1.3e-6, atol=0)
    applier(multi_tensor_scale, flag, [grads, grads], (1.0 / 64) / norm.item())
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got.double(), (expected / want_norm).to(got.dtype).double(),
                                   rtol=2**-7 if got.dtype == torch.bfloat16 else 1.3e-6, atol=1e-6)
    assert int(flag) == 0
