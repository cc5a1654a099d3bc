"""multi_tensor_adam on torch's fused Adam kernels, run on the CPU (torch has CPU fused Adam)
against the reference; and its decline reasons."""
import pytest
import torch
from te_backend_cuda import optimizer
from te_core.reference import optimizer as ref


def _state(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (33,), (2, 3, 4)]
    return [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(3)] + [
        [torch.rand(s, generator=g).to(dtype) for s in shapes]]


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_reference(adam_w_mode):
    got = _state(1)
    want = [[t.clone() for t in lst] for lst in got]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=3, adam_w_mode=adam_w_mode)
    optimizer.multi_tensor_adam(*got, **hyper)
    ref.multi_tensor_adam(*want, **hyper)
    for g_lst, w_lst in zip(got, want):
        for g_t, w_t in zip(g_lst, w_lst):
            torch.testing.assert_close(g_t, w_t, rtol=1.3e-6, atol=1e-5)


def test_declines_with_reasons():
    p, g, m, v = _state(2)
    ok, why = optimizer.supports_multi_tensor_adam(p, g, m, v, bias_correction=False)
    assert not ok and "bias correction" in why
    ok, why = optimizer.supports_multi_tensor_adam(p, g, m, v)
    assert not ok and "not on a CUDA device" in why
