"""On the GPU only: MultiheadAttention's QKV projection hands q, k and v's gradients to the FP8
cast as column blocks (split_sizes; dbias_cast_transpose_parts reads them in place). Three
delayed-scaling steps must equal, bit for bit, the same module with the output unsplit (autograd
concatenating the gradients, then the one-tensor cast)."""
import copy

import pytest
import torch

import te_core as te
from te_core.modules import layernorm_linear, linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _steps(module, x0, dy):
    for _ in range(3):
        module.zero_grad()
        x = x0.clone().requires_grad_(True)
        with te.autocast(recipe=te.recipe.DelayedScaling()):
            y = module(x)
        y.backward(dy)
    proj = module.layernorm_qkv if module.input_layernorm else module.qkv
    return [y.detach(), x.grad, proj.weight.grad, proj.bias.grad]


@pytest.mark.parametrize("input_layernorm", [False, True])
def test_split_qkv_gradients_match_the_concatenated_ones(monkeypatch, input_layernorm):
    torch.manual_seed(0)
    mha = te.MultiheadAttention(512, 4, attention_dropout=0.0, attn_mask_type="causal", input_layernorm=input_layernorm,
                                params_dtype=torch.bfloat16, device="cuda")
    twin = copy.deepcopy(mha)
    x0 = torch.randn(128, 2, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x0)
    got = _steps(mha, x0, dy)
    for cls in (linear.Linear, layernorm_linear.LayerNormLinear):  # the same modules, never splitting
        forward = cls.forward
        monkeypatch.setattr(cls, "forward", lambda self, inp, *a, split_sizes=None, _f=forward, **k: _f(self, inp, *a, **k))
    want = _steps(twin, x0, dy)
    for name, a, b in zip(("y", "dx", "dW_qkv", "db_qkv"), got, want):
        assert a.abs().sum() > 0, name
        assert torch.equal(a, b), f"{name}: max difference {(a.float() - b.float()).abs().max().item()}"
