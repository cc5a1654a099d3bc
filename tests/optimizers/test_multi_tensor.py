"""Transformer Engine's multi-tensor helpers (multi_tensor_applier / MultiTensorApply with
multi_tensor_scale, multi_tensor_scale_tensor, multi_tensor_l2norm and multi_tensor_unscale_l2norm,
apex's interface) against float64 computations on fresh random tensors of several dtypes and
shapes, with Transformer Engine's kernels' rules: float32 arithmetic, the flag, empty tensors."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.optimizers import (MultiTensorApply, multi_tensor_applier, multi_tensor_l2norm, multi_tensor_scale,
                                multi_tensor_scale_tensor, multi_tensor_unscale_l2norm)


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


def _float32_product(src: torch.Tensor, scale) -> torch.Tensor:
    """float32(src) * float32(scale) rounded once to float32, computed in float64 (two float32
    values' product is exact there), as Transformer Engine's scale kernel computes it."""
    scale32 = torch.tensor(float(scale), dtype=torch.float32).double()
    return (src.float().double() * scale32).float()


SCALE_OPS = pytest.mark.parametrize("as_tensor", [False, True], ids=["float scale", "tensor scale"])


def _scale_op(as_tensor, scale):
    return (multi_tensor_scale_tensor, torch.tensor([scale])) if as_tensor else (multi_tensor_scale, scale)


@SCALE_OPS
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_multiplies_in_float32_into_the_destination_dtype(as_tensor, dst_dtype):
    """Main gradients from model ones (float32 destinations of bf16 sources) and back: the product
    is float32's, rounded once into the destination (a bf16 product rounded twice differs)."""
    sources = _tensors(1, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    destinations = [torch.empty_like(t, dtype=dst_dtype) for t in sources]
    flag = torch.zeros(1, dtype=torch.int)
    op, scale = _scale_op(as_tensor, 0.37)
    multi_tensor_applier(op, flag, [sources, destinations], scale)
    for src, dst in zip(sources, destinations):
        assert dst.dtype == dst_dtype
        torch.testing.assert_close(dst, _float32_product(src, 0.37).to(dst_dtype), rtol=0, atol=0)
    assert int(flag) == 0


@SCALE_OPS
def test_scale_of_half_precision_sources_keeps_float32_range(as_tensor):
    """1000 (float16) x 100 fits float32, not float16: the float32 destination holds 1e5, unflagged."""
    src = torch.tensor([1000.0, -2.0, 0.5], dtype=torch.float16)
    dst = torch.zeros(3)
    flag = torch.zeros(1, dtype=torch.int)
    op, scale = _scale_op(as_tensor, 100.0)
    multi_tensor_applier(op, flag, [[src], [dst]], scale)
    assert dst.tolist() == [100000.0, -200.0, 50.0] and int(flag) == 0


@SCALE_OPS
def test_scale_flags_non_finite_inputs_not_overflowing_outputs(as_tensor):
    """As Transformer Engine's kernel: the flag says a source held an inf or NaN; a finite value
    whose product overflows is written as inf, unflagged. A raised flag stays raised."""
    flag = torch.zeros(1, dtype=torch.int)
    op, scale = _scale_op(as_tensor, 1e10)
    dst = torch.zeros(2)
    multi_tensor_applier(op, flag, [[torch.tensor([1e30, 2.0])], [dst]], scale)
    assert dst[0].item() == float("inf") and int(flag) == 0
    for bad in (float("inf"), float("nan")):
        flag.zero_()
        sources = _tensors(2)
        sources[1][3] = bad
        destinations = [torch.empty_like(t, dtype=torch.float32) for t in sources]
        multi_tensor_applier(op, flag, [sources, destinations], 0.5 if not as_tensor else torch.tensor(0.5))
        assert int(flag) == 1
        multi_tensor_applier(op, flag, [_tensors(3), [torch.empty_like(t, dtype=torch.float32) for t in sources]],
                             0.5 if not as_tensor else torch.tensor(0.5))
        assert int(flag) == 1


@SCALE_OPS
def test_scale_in_place_as_gradient_clipping_calls_it(as_tensor):
    """Megatron-LM clips with [grads, grads]: each tensor scaled in place."""
    grads = _tensors(4)
    want = [_float32_product(g, 0.25).to(g.dtype) for g in grads]
    op, scale = _scale_op(as_tensor, 0.25)
    multi_tensor_applier(op, torch.zeros(1, dtype=torch.int), [grads, grads], scale)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@SCALE_OPS
def test_zero_size_tensors_are_skipped(as_tensor):
    """Transformer Engine's applier drops the slots of empty tensors (a bias of an empty shard)
    before its kernels run; called directly, the ops skip them too."""
    sources = [torch.zeros(0), *_tensors(5), torch.zeros(0, 3)]
    destinations = [torch.zeros(0), *[torch.empty_like(t, dtype=torch.float32) for t in sources[1:-1]],
                    torch.zeros(0, 3)]
    op, scale = _scale_op(as_tensor, 3.0)
    for call in (lambda f: multi_tensor_applier(op, f, [sources, destinations], scale),
                 lambda f: op(2048, f, [sources, destinations], scale)):
        flag = torch.zeros(1, dtype=torch.int)
        for dst in destinations:
            dst.zero_()
        call(flag)
        for src, dst in zip(sources[1:-1], destinations[1:-1]):
            torch.testing.assert_close(dst, _float32_product(src, 3.0), rtol=0, atol=0)
        assert int(flag) == 0
    tensors = _tensors(6)
    total, each = multi_tensor_applier(multi_tensor_l2norm, torch.zeros(1, dtype=torch.int),
                                       [[torch.zeros(0), *tensors]], True)
    torch.testing.assert_close(each.double(), torch.stack([t.double().norm() for t in tensors]), rtol=1.3e-6, atol=1e-5)
    assert multi_tensor_applier(multi_tensor_l2norm, torch.zeros(1, dtype=torch.int), [[torch.zeros(0)]]) is None


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_l2norm_flags_a_norm_that_is_not_finite(bad):
    tensors = _tensors(7)
    flag = torch.zeros(1, dtype=torch.int)
    multi_tensor_applier(multi_tensor_l2norm, flag, [tensors], False)
    assert int(flag) == 0
    tensors[2][1, 2, 3] = bad
    total, _ = multi_tensor_applier(multi_tensor_l2norm, flag, [tensors], False)
    assert not torch.isfinite(total).any() and int(flag) == 1
    flag.zero_()
    multi_tensor_applier(multi_tensor_unscale_l2norm, flag, [tensors], torch.tensor([0.5]), False)
    assert int(flag) == 1


def test_unscale_l2norm_is_the_norm_of_the_unscaled_tensors():
    """The norm of tensors * inv_scale, all together and one by one; the tensors stay as they were."""
    tensors = _tensors(8)
    before = [t.clone() for t in tensors]
    inv_scale = torch.tensor([2.0**-7 * 1.5])
    flag = torch.zeros(1, dtype=torch.int)
    total, each = multi_tensor_applier(multi_tensor_unscale_l2norm, flag, [tensors], inv_scale, True)
    want_each = torch.stack([(t.double() * inv_scale.double()).norm() for t in tensors])
    torch.testing.assert_close(each.double(), want_each, rtol=1.3e-6, atol=1e-9)
    torch.testing.assert_close(total.double(), want_each.norm().reshape(1), rtol=1.3e-6, atol=1e-9)
    assert total.dtype == torch.float32 and total.shape == (1,) and int(flag) == 0
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    _, nothing = multi_tensor_applier(multi_tensor_unscale_l2norm, flag, [tensors], inv_scale)
    assert nothing.numel() == 0
    with pytest.raises(TypeError, match="multi_tensor_unscale_l2norm: inv_scale must be a one-element tensor"):
        multi_tensor_unscale_l2norm(2048, flag, [tensors], torch.ones(2))


def test_multi_tensor_apply_passes_its_chunk_size_and_checks_the_lists():
    """Transformer Engine's MultiTensorApply: op(chunk_size, flag, lists, *args), misaligned lists
    refused with the RuntimeError Transformer Engine raises; the caller's lists are left as given."""
    seen = []
    applier = MultiTensorApply(1024)
    lists = [[torch.ones(2), torch.zeros(0)], [torch.ones(2), torch.zeros(0)]]
    applier(lambda *args: seen.append(args), "flag", lists, "extra")
    (chunk_size, flag, given, extra), = seen
    assert (chunk_size, flag, extra) == (1024, "flag", "extra") and [len(t) for t in given] == [1, 1]
    assert [len(t) for t in lists] == [2, 2]
    with pytest.raises(RuntimeError, match=r"tensor_lists must be one or more lists of equal length.*\[2, 1\]") as info:
        applier(multi_tensor_scale, torch.zeros(1, dtype=torch.int), [lists[0], lists[1][:1]], 2.0)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        MultiTensorApply(0)
    with pytest.raises(ValueError, match=r"multi_tensor_scale: tensor_lists must be \[sources, destinations\]"):
        multi_tensor_applier(multi_tensor_scale, torch.zeros(1, dtype=torch.int), [lists[0]], 2.0)
    with pytest.raises(TypeError, match="multi_tensor_scale: scale must be a real number, got str"):
        multi_tensor_applier(multi_tensor_scale, torch.zeros(1, dtype=torch.int), lists, "2")


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
