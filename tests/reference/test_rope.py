"""Reference RoPE against a float64 complex-number rotation; backward against its autograd."""
import pytest
import torch

from te_core.reference import rope

TOLS = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


def rope64(x, f, interleaved):
    """x (s, b, h, d) float64, f (s, r/2) angles: rotate channel pairs as complex numbers by e^{i f}."""
    r = 2 * f.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    if interleaved:
        re, im = rot[..., 0::2], rot[..., 1::2]
    else:
        re, im = rot[..., : r // 2], rot[..., r // 2 :]
    z = torch.complex(re, im) * torch.polar(torch.ones_like(f), f)[:, None, None, :]
    if interleaved:
        out = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    else:
        out = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([out, rest], dim=-1)


def freqs_for(s, r, interleaved, extra_rows=0):
    """The contract's freqs (s, 1, 1, r) and the r/2 angles each channel pair is rotated by."""
    f = torch.randn(s + extra_rows, r // 2) * 3
    # interleaved: TE's layout, each channel of a pair holds the pair's angle: [f0, f0, f1, f1, ...]
    full = torch.cat([f, f], -1) if not interleaved else torch.stack([f, f], -1).flatten(-2)
    return full[:, None, None, :].float(), f[:s].double()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r", [38, 24])
def test_rope(interleaved, tensor_format, dtype, r):
    s, b, h, d = 7, 3, 2, 38
    freqs, f = freqs_for(s, r, interleaved, extra_rows=2 if r == 24 else 0)
    x_sbhd = torch.randn(s, b, h, d).to(dtype)
    dy_sbhd = torch.randn(s, b, h, d).to(dtype)
    to_fmt = (lambda t: t) if tensor_format == "sbhd" else (lambda t: t.transpose(0, 1).contiguous())
    y = rope.rope_fwd(to_fmt(x_sbhd), freqs, tensor_format=tensor_format, interleaved=interleaved)
    x64 = x_sbhd.double().requires_grad_()
    y64 = rope64(x64, f, interleaved)
    assert y.dtype == dtype and y.shape == to_fmt(x_sbhd).shape
    torch.testing.assert_close(y.double(), to_fmt(y64.detach()).to(dtype).double(), **TOLS[dtype])
    assert torch.equal(y[..., r:], to_fmt(x_sbhd)[..., r:])
    y64.backward(dy_sbhd.double())
    dx = rope.rope_bwd(to_fmt(dy_sbhd), freqs, tensor_format=tensor_format, interleaved=interleaved)
    torch.testing.assert_close(dx.double(), to_fmt(x64.grad).to(dtype).double(), **TOLS[dtype])


def test_bad_inputs():
    x = torch.randn(4, 2, 2, 8)
    with pytest.raises(ValueError, match=r"tensor_format='sbh' is not supported; allowed values: 'sbhd', 'bshd'"):
        rope.rope_fwd(x, torch.zeros(4, 1, 1, 8), tensor_format="sbh")
    with pytest.raises(ValueError, match=r"freqs has shape \(3, 1, 1, 8\); expected \(s, 1, 1, r\) with s >= 4"):
        rope.rope_fwd(x, torch.zeros(3, 1, 1, 8))
    with pytest.raises(ValueError, match=r"r=10 channels; r must be even and <= the head dim 8"):
        rope.rope_bwd(x, torch.zeros(4, 1, 1, 10))
    with pytest.raises(ValueError, match=r"r=5 channels"):
        rope.rope_fwd(x, torch.zeros(4, 1, 1, 5))
    with pytest.raises(ValueError, match=r"x must be 4-D, got shape \(4, 8\)"):
        rope.rope_fwd(x[:, 0, 0], torch.zeros(4, 1, 1, 8))
