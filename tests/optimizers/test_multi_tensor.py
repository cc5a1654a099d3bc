"""Transformer Engine's multi-tensor helpers (multi_tensor_applier with multi_tensor_scale,
multi_tensor_scale_tensor and multi_tensor_l2norm, apex's interface) against float64
computations on fresh random tensors of several dtypes and shapes."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.optimizers import multi_tensor_applier, multi_tensor_l2norm, multi_tensor_scale, multi_tensor_scale_tensor


def _tensors(seed: int, dtypes=(torch.float32, torch.bfloat16, torch.float32)):
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 5), (128,), (3, 4, 9)]
    return [torch.randn(s, generator=g).to(d) for s, d in zip(shapes, dtypes)]


def test_l2norm_of_all_tensors_and_of_each():
    tensors = _tensors(0)
    flag = torch.zeros(1, dtype=torch.int)
    total, each = multi_tensor_applier(multi_tensor_l2norm, flag, [tensors], True)
    want_each = torch.stack([t.double().norm() for t in tensors])
    torch.testing.assert_close(each.double(), want_each, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(total.double(), want_each.norm().reshape(1), rtol=1.3e-6, atol=1e-5)
    assert total.dtype == torch.float32 and total.shape == (1,)
    total_only, nothing = multi_tensor_applier(multi_tensor_l2norm, flag, [tensors], False)
    assert torch.equal(total_only, total) and nothing.numel() == 0 and int(flag) == 0


@pytest.mark.parametrize("as_tensor", [False, True], ids=["float scale", "tensor scale"])
def test_scale_copies_scaled_sources_into_destinations_and_flags_overflow(as_tensor):
    sources = _tensors(1)
    destinations = [torch.empty_like(t, dtype=torch.float32) for t in sources]  # e.g. main gradients
    flag = torch.zeros(1, dtype=torch.int)
    op, scale = (multi_tensor_scale_tensor, torch.tensor([0.37])) if as_tensor else (multi_tensor_scale, 0.37)
    multi_tensor_applier(op, flag, [sources, destinations], scale)
    for src, dst in zip(sources, destinations):
        want = (src * (scale if not as_tensor else scale.reshape(()))).double()  # the product in the source's dtype
        torch.testing.assert_close(dst.double(), want, rtol=0, atol=0)
    assert int(flag) == 0
    sources[1][3] = float("inf")
    multi_tensor_applier(op, flag, [sources, destinations], scale)
    assert int(flag) == 1  # an overflow is flagged on the device, as apex's kernels do
    with pytest.raises(ValueError, match="sources, destinations"):
        multi_tensor_applier(op, flag, [sources], scale)


def test_the_stand_in_exports_them_where_megatron_imports_them():
    from te_core.compat.transformer_engine import uninstall_transformer_engine

    import importlib.util
    import sys

    if "transformer_engine" not in sys.modules and importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("a real transformer_engine is installed here")
    te.install_as_transformer_engine()
    try:
        from transformer_engine.pytorch.optimizers import multi_tensor_applier as applier
        from transformer_engine.pytorch.optimizers import multi_tensor_l2norm as l2norm

        assert applier is multi_tensor_applier and l2norm is multi_tensor_l2norm
    finally:
        uninstall_transformer_engine()
