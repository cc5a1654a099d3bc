"""apply_rotary_pos_emb(start_positions=...): each sequence of the batch rotated from its own
start position (Transformer Engine's argument, for a KV cache's next tokens), in Transformer
Engine's argument order."""
from __future__ import annotations

import pytest
import torch

import te_core.modules as tm

SEQ, BATCH, HEADS, DIM = 5, 4, 2, 16


def _expected(t, starts, tensor_format, interleaved, base=10000.0):
    """The rotation computed in float64 from the positions themselves."""
    x = t.double() if tensor_format == "bshd" else t.double().transpose(0, 1)  # (b, s, h, d)
    inv = 1.0 / base ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM)
    out = torch.empty_like(x)
    for i, start in enumerate(starts):
        angles = torch.outer(torch.arange(start, start + SEQ, dtype=torch.float64), inv)  # (s, d/2)
        cos, sin = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]
        if interleaved:
            even, odd = x[i, ..., 0::2], x[i, ..., 1::2]
            out[i, ..., 0::2], out[i, ..., 1::2] = even * cos - odd * sin, odd * cos + even * sin
        else:
            a, b = x[i, ..., : DIM // 2], x[i, ..., DIM // 2:]
            out[i] = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return out if tensor_format == "bshd" else out.transpose(0, 1)


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_each_sequence_from_its_start(tensor_format, interleaved):
    torch.manual_seed(0)
    shape = (SEQ, BATCH, HEADS, DIM) if tensor_format == "sbhd" else (BATCH, SEQ, HEADS, DIM)
    t = torch.randn(shape, requires_grad=True)
    starts = [3, 0, 7, 3]  # repeated and distinct starts
    freqs = tm.RotaryPositionEmbedding(DIM, interleaved=interleaved)(16)
    y = tm.apply_rotary_pos_emb(t, freqs, tensor_format, start_positions=torch.tensor(starts),
                                interleaved=interleaved)
    want = _expected(t.detach(), starts, tensor_format, interleaved)
    torch.testing.assert_close(y.double(), want, rtol=1.3e-6, atol=1e-5)
    # the gradient is the inverse rotation of the output gradient (float64 autograd of the same)
    dy = torch.randn(shape)
    y.backward(dy)
    t64 = t.detach().double().requires_grad_()
    _expected(t64, starts, tensor_format, interleaved).backward(dy.double())
    torch.testing.assert_close(t.grad.double(), t64.grad, rtol=1.3e-6, atol=1e-5)


def test_starts_of_zero_equal_no_starts():
    torch.manual_seed(1)
    t = torch.randn(SEQ, BATCH, HEADS, DIM)
    freqs = tm.RotaryPositionEmbedding(DIM)(SEQ)
    got = tm.apply_rotary_pos_emb(t, freqs, start_positions=torch.zeros(BATCH, dtype=torch.int64))
    assert torch.equal(got, tm.apply_rotary_pos_emb(t, freqs))


def test_transformer_engine_argument_order():
    """TE's order is (t, freqs, tensor_format, start_positions, interleaved, fused, ...): a fifth
    positional argument is `interleaved`, a fourth the starts."""
    torch.manual_seed(2)
    t = torch.randn(SEQ, BATCH, HEADS, DIM)
    freqs = tm.RotaryPositionEmbedding(DIM, interleaved=True)(8)
    by_position = tm.apply_rotary_pos_emb(t, freqs, "sbhd", torch.tensor([1, 2, 3, 0]), True)
    by_name = tm.apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=torch.tensor([1, 2, 3, 0]),
                                      interleaved=True)
    assert torch.equal(by_position, by_name)
    torch.testing.assert_close(by_position.double(), _expected(t, [1, 2, 3, 0], "sbhd", True), rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("starts, match", [
    (torch.tensor([0, 1, 2]), r"shape \(4,\)"),  # one per sequence
    (torch.tensor([0.0, 1.0, 2.0, 3.0]), "integer tensor"),
    ([0, 1, 2, 3], "integer tensor"),
    (torch.tensor([0, 1, 2, 12]), "reach position 16"),  # 12 + 5 tokens > the 16 positions of freqs
    (torch.tensor([0, -1, 2, 3]), "must not be negative"),
])
def test_bad_starts_say_what_is_wrong(starts, match):
    t = torch.randn(SEQ, BATCH, HEADS, DIM)
    freqs = tm.RotaryPositionEmbedding(DIM)(16)
    with pytest.raises(ValueError, match=match):
        tm.apply_rotary_pos_emb(t, freqs, start_positions=starts)


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
def test_interleaved_rotates_pairs_as_transformer_engine(tensor_format):
    """Interleaved (GPT-J): channels (2k, 2k+1) rotate as a pair by angle f_k, with the angles in
    RotaryPositionEmbedding(interleaved=True)'s layout [f0, f0, f1, f1, ...]."""
    torch.manual_seed(3)
    shape = (SEQ, BATCH, HEADS, DIM) if tensor_format == "sbhd" else (BATCH, SEQ, HEADS, DIM)
    t = torch.randn(shape)
    freqs = tm.RotaryPositionEmbedding(DIM, interleaved=True)(SEQ)
    got = tm.apply_rotary_pos_emb(t, freqs, tensor_format, interleaved=True)
    torch.testing.assert_close(got.double(), _expected(t, [0] * BATCH, tensor_format, True), rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_gradient_is_exact_for_freqs_whose_pairs_differ(fmt, interleaved):
    """apply_rotary_pos_emb's input gradient is the forward's transpose for any float freqs of
    shape (s, 1, 1, r), not only those built with equal angles per rotated pair (TE's contract):
    checked against float64 autograd through the same forward formula."""
    g = torch.Generator().manual_seed(11)
    s, b, h, d, r = 6, 2, 2, 16, 12
    shape = (s, b, h, d) if fmt == "sbhd" else (b, s, h, d)
    x = torch.randn(shape, generator=g, device="cpu")
    freqs = torch.rand(s, 1, 1, r, generator=g, device="cpu") * 6
    dy = torch.randn(shape, generator=g, device="cpu")

    def forward64(t):
        t = t if fmt == "sbhd" else t.transpose(0, 1)
        f = freqs.double()
        part, rest = t[..., :r], t[..., r:]
        if interleaved:
            rot = torch.stack([-part[..., 1::2], part[..., 0::2]], -1).flatten(-2)
        else:
            rot = torch.cat([-part[..., r // 2:], part[..., : r // 2]], -1)
        y = torch.cat([part * f.cos() + rot * f.sin(), rest], -1)
        return y if fmt == "sbhd" else y.transpose(0, 1)

    x64 = x.double().requires_grad_()
    forward64(x64).backward(dy.double())
    here = x.to(torch.get_default_device()).requires_grad_()
    y = tm.apply_rotary_pos_emb(here, freqs.to(here.device), fmt, interleaved=interleaved)
    y.backward(dy.to(here.device))
    torch.testing.assert_close(y.double().cpu(), forward64(x.double()), rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(here.grad.double().cpu(), x64.grad, rtol=1.3e-6, atol=1e-5)


def test_rotary_embedding_state_dict_holds_inv_freq_as_transformer_engines():
    """TE registers inv_freq as a persistent buffer: its checkpoints hold it, and a model holding a
    RotaryPositionEmbedding loads them strictly; a state dict without it (te-core's earlier ones)
    still loads, keeping the frequencies made from the same arguments."""
    emb = tm.RotaryPositionEmbedding(32, rotary_base=500.0)
    assert list(emb.state_dict()) == ["inv_freq"]
    want = 1.0 / (500.0 ** (torch.arange(0, 32, 2, dtype=torch.float64, device="cpu") / 32))
    torch.testing.assert_close(emb.inv_freq.double().cpu(), want, rtol=1.3e-6, atol=1e-5)
    other = tm.RotaryPositionEmbedding(32)
    other.load_state_dict(emb.state_dict())  # strict
    assert torch.equal(other(8), emb(8))
    fresh = tm.RotaryPositionEmbedding(32, rotary_base=500.0)
    assert fresh.load_state_dict({}, strict=True).missing_keys == []
    assert torch.equal(fresh(8), emb(8))


def test_odd_rotary_width_makes_ceil_half_frequencies_as_transformer_engine():
    emb = tm.RotaryPositionEmbedding(10, rotary_percent=0.5)  # 5 channels: frequencies of 0, 2, 4
    freqs = emb(4)
    assert freqs.shape == (4, 1, 1, 6)
    want = torch.outer(torch.arange(4, dtype=torch.float64, device="cpu"),
                       1.0 / (10000.0 ** (torch.arange(0, 5, 2, device="cpu") / 5)))
    torch.testing.assert_close(freqs[:, 0, 0, :3].double().cpu(), want, rtol=1.3e-6, atol=1e-5)
