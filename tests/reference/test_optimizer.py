"""Reference multi-tensor Adam against torch.optim.Adam / AdamW over several steps."""
import pytest
import torch

from te_core.reference import optimizer

SHAPES = [(7, 13), (31,), (3, 5, 2)]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)


def run_reference(params, grads_per_step, adam_w_mode, bias_correction=True):
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(grads_per_step, start=1):
        optimizer.multi_tensor_adam(
            params, grads, ms, vs, step=step, adam_w_mode=adam_w_mode, bias_correction=bias_correction, **HYPER
        )
    return ms, vs


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_torch_adam(adam_w_mode):
    init = [torch.randn(s) for s in SHAPES]
    grads_per_step = [[torch.randn(s) for s in SHAPES] for _ in range(4)]
    params = [p.clone() for p in init]
    ms, vs = run_reference(params, grads_per_step, adam_w_mode)
    torch_params = [p.clone().requires_grad_() for p in init]
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    opt = cls(torch_params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
              weight_decay=HYPER["weight_decay"], foreach=False)
    for grads in grads_per_step:
        for p, g in zip(torch_params, grads):
            p.grad = g.clone()
        opt.step()
    for p, tp, m, v in zip(params, torch_params, ms, vs):
        state = opt.state[tp]
        torch.testing.assert_close(p, tp.detach(), rtol=1.3e-6, atol=1e-7)
        torch.testing.assert_close(m, state["exp_avg"], rtol=1.3e-6, atol=1e-7)
        torch.testing.assert_close(v, state["exp_avg_sq"], rtol=1.3e-6, atol=1e-9)
    assert not torch.equal(params[0], init[0])


def test_no_bias_correction_formula():
    p, g = torch.randn(40), torch.randn(40)
    p64, g64 = p.double(), g.double()
    run_reference([p], [[g]], adam_w_mode=True, bias_correction=False)
    m = (1 - HYPER["beta1"]) * g64
    v = (1 - HYPER["beta2"]) * g64 * g64
    want = p64 * (1 - HYPER["lr"] * HYPER["weight_decay"]) - HYPER["lr"] * m / (v.sqrt() + HYPER["eps"])
    torch.testing.assert_close(p.double(), want, rtol=1.3e-6, atol=1e-6)


def test_low_precision_params_keep_their_dtype():
    p32 = torch.randn(64)
    p16 = p32.bfloat16()
    g = torch.randn(64)
    m16, v16 = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
    optimizer.multi_tensor_adam([p16], [g.bfloat16()], [m16], [v16], step=1, **HYPER)
    run_reference([p32], [[g.bfloat16().float()]], adam_w_mode=True)
    assert p16.dtype == m16.dtype == v16.dtype == torch.bfloat16
    torch.testing.assert_close(p16.float(), p32, rtol=1.6e-2, atol=1e-5)


def test_bad_inputs():
    p = [torch.randn(3)]
    with pytest.raises(ValueError, match=r"the tensor lists must have the same length, got .*'grads': 0"):
        optimizer.multi_tensor_adam(p, [], [torch.zeros(3)], [torch.zeros(3)], step=1, **HYPER)
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] has shape \(4,\); params\[0\] has \(3,\)"):
        optimizer.multi_tensor_adam(p, [torch.zeros(3)], [torch.zeros(4)], [torch.zeros(3)], step=1, **HYPER)
    with pytest.raises(ValueError, match=r"step=0: it counts this step, so it starts at 1"):
        optimizer.multi_tensor_adam(p, [torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], step=0, **HYPER)
