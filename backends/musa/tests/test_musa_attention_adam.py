"""attention (SDPA) and multi_tensor_adam (torch fused Adam): the same torch calls the backend
makes on MUSA, run on CPU torch, against float64 math and torch.optim."""
from __future__ import annotations

import math

import pytest
import torch

from te_backend_musa.ops import attention as attn
from te_backend_musa.ops import optimizer

# Attention outputs are weighted means of O(1) values: bf16 rounding of intermediates shows up
# as absolute error of about bf16's epsilon, so atol is bf16's rtol here.
ATTN_TOL = dict(rtol=1.6e-2, atol=1.6e-2)


def _attention64(q, k, v, masked, scale):
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a fully masked row gives zeros
    return p @ v


def _inputs(b, hq, hkv, sq, sk, d, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).bfloat16().requires_grad_()  # noqa: E731
    return mk(b, hq, sq, d), mk(b, hkv, sk, d), mk(b, hkv, sk, d), g


@pytest.mark.parametrize("mask_type, sq, sk", [
    ("no_mask", 5, 9), ("causal", 7, 7), ("causal", 4, 9), ("causal_bottom_right", 9, 4),
    ("padding", 5, 9), ("padding_causal", 6, 6), ("arbitrary", 5, 9),
])
def test_attention_against_float64(mask_type, sq, sk):
    q, k, v, g = _inputs(2, 4, 2, sq, sk, 16, seed=sq * 10 + sk)
    mask = None
    if mask_type in ("padding", "padding_causal"):
        mask = torch.zeros(2, 1, 1, sk, dtype=torch.bool)
        mask[0, ..., sk - 2:] = True
        mask[1] = True  # every key masked: rows must come out as zeros
    elif mask_type == "arbitrary":
        mask = torch.rand(2, 4, sq, sk, generator=g) < 0.4
    scale = 0.3
    out = attn.attention(q, k, v, attn_mask_type=mask_type, attention_mask=mask, softmax_scale=scale)
    masked = attn.masked_out(mask_type, mask, sq, sk, q.device)
    want = _attention64(q, k, v, masked, scale)
    assert out.dtype == q.dtype and out.shape == (2, 4, sq, 16)
    torch.testing.assert_close(out.double(), want, **ATTN_TOL)

    dout = torch.randn(out.shape, generator=g).bfloat16()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want_grads = torch.autograd.grad(_attention64(q64, k64, v64, masked, scale), (q64, k64, v64), dout.double())
    for got, ref in zip(grads, want_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), ref, **ATTN_TOL)


def test_fully_masked_rows_are_zero():
    q, k, v, _ = _inputs(1, 2, 2, 6, 3, 8, seed=1)
    out = attn.attention(q, k, v, attn_mask_type="causal_bottom_right")
    assert torch.equal(out[:, :, :3].float(), torch.zeros(1, 2, 3, 8))  # rows 0..2 see no key
    assert (out[:, :, 3:].abs() > 0).any()


def test_default_scale_is_inverse_sqrt_d():
    q, k, v, _ = _inputs(1, 2, 1, 4, 4, 32, seed=2)
    out = attn.attention(q, k, v)
    torch.testing.assert_close(out.double(), _attention64(q, k, v, None, 1 / math.sqrt(32)), **ATTN_TOL)


def test_attention_supports():
    q, k, v, _ = _inputs(1, 4, 2, 4, 4, 64, seed=3)
    assert attn.attention_supports(q, k, v) == (True, "")
    ok, why = attn.attention_supports(q.float(), k.float(), v.float())
    assert not ok and "needs float16 or bfloat16" in why
    big = torch.zeros(1, 4, 4, 256, dtype=torch.bfloat16)
    ok, why = attn.attention_supports(big, big, big)
    assert not ok and "head dims (qk, v) = (256, 256)" in why
    ok, why = attn.attention_supports(q, k, v, attn_mask_type="padding")
    assert not ok and "needs attention_mask" in why
    ok, why = attn.attention_supports(q, k, v, attn_mask_type="sliding")
    assert not ok and "'sliding' is not one of" in why
    q3 = torch.zeros(1, 3, 4, 64, dtype=torch.bfloat16)
    ok, why = attn.attention_supports(q3, k, v)
    assert not ok and "not a multiple of kv heads" in why


def test_attention_extra_head_dims_need_arch_22(fake_musa):
    q, v = torch.zeros(1, 2, 4, 192, dtype=torch.bfloat16), torch.zeros(1, 2, 4, 128, dtype=torch.bfloat16)
    fake_musa(arch=(2, 2))
    assert attn.attention_supports(q, q, v) == (True, "")
    fake_musa(arch=(2, 1))
    assert not attn.attention_supports(q, q, v)[0]


# -- Adam --------------------------------------------------------------------------------------
def _adam_case(dtype, seed=9):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 13), (129,), (3, 4, 5)]
    params = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(3)]
    return params, grads


HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _run(step_fn, params, grads, adam_w_mode):
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    for step, gs in enumerate(grads, start=1):
        step_fn(params, gs, exp_avgs, exp_avg_sqs, step=step, adam_w_mode=adam_w_mode, **HYPER)
    return params, exp_avgs, exp_avg_sqs


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_float32_matches_torch_optim(adam_w_mode):
    params, grads = _adam_case(torch.float32)
    ref_params = [p.clone().requires_grad_() for p in params]
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = cls(ref_params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for gs in grads:
        for p, gr in zip(ref_params, gs):
            p.grad = gr.clone()
        ref.step()
    got, exp_avgs, exp_avg_sqs = _run(optimizer.multi_tensor_adam, params, grads, adam_w_mode)
    for p, m, v, rp in zip(got, exp_avgs, exp_avg_sqs, ref_params):
        torch.testing.assert_close(p, rp.detach(), rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(m, ref.state[rp]["exp_avg"], rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(v, ref.state[rp]["exp_avg_sq"], rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_bfloat16_matches_reference_backend(adam_w_mode):
    """16-bit tensors: float32 math, stored back rounded (torch.optim itself would do bf16 math)."""
    reference = pytest.importorskip("te_core.reference.optimizer").multi_tensor_adam
    params, grads = _adam_case(torch.bfloat16)
    want = _run(reference, [p.clone() for p in params], grads, adam_w_mode)
    got = _run(optimizer.multi_tensor_adam, params, grads, adam_w_mode)
    for got_list, want_list in zip(got, want):
        for a, b in zip(got_list, want_list):
            assert a.dtype == torch.bfloat16
            torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-5)


def test_adam_supports():
    p = [torch.randn(3)]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)
    assert optimizer.multi_tensor_adam_supports(p, p, p, p, **kw) == (True, "")
    ok, why = optimizer.multi_tensor_adam_supports(p, p, p, p, bias_correction=False, **kw)
    assert not ok and "always applies bias correction" in why
    ok, why = optimizer.multi_tensor_adam_supports(p, [p[0].bfloat16()], p, p, **kw)
    assert not ok and "one dtype and device" in why
    ok, why = optimizer.multi_tensor_adam_supports(p, p, p, [], **kw)
    assert not ok and "same length" in why


@pytest.mark.parametrize("mask_type, sq, sk", [("padding_causal", 5, 9), ("causal", 9, 4), ("causal_bottom_right", 9, 4)])
def test_attention_matches_reference_backend(mask_type, sq, sk):
    reference = pytest.importorskip("te_core.reference.attention").attention
    q, k, v, _ = _inputs(2, 4, 2, sq, sk, 16, seed=5)
    mask = None
    if mask_type == "padding_causal":
        mask = torch.zeros(2, 1, 1, sk, dtype=torch.bool)
        mask[0, ..., sk - 2:] = True
    got = attn.attention(q, k, v, attn_mask_type=mask_type, attention_mask=mask)
    want = reference(q, k, v, attn_mask_type=mask_type, attention_mask=mask)
    torch.testing.assert_close(got.double(), want.double(), **ATTN_TOL)
