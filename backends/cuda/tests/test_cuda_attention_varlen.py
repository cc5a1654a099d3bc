"""ops.attention_varlen on the cuda backend: torch's FlashAttention-2 varlen kernels against a
float64 computation of each packed sequence on its own.

On the CPU: supports() and its reasons (CUDA mocked), and the autograd glue with the two kernels
replaced by a float64 emulation of FlashAttention's documented semantics (bottom-right diagonal,
native GQA), which checks what is passed where against the reference backend. On a GPU with
compute capability 8.0 or newer: the kernels themselves, forward and gradients, through the op
and through DotProductAttention(qkv_format="thd") with fallback made an error.
"""
import math
import warnings

import pytest
import torch
from te_backend_cuda import attention_varlen as varlen
from te_core.reference import attention as ref

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= varlen.MIN_CAPABILITY
needs_gpu = pytest.mark.skipif(not GPU, reason="needs an NVIDIA GPU with compute capability 8.0 or newer")
# relative to the largest reference value: the kernels multiply the probabilities in the inputs' dtype
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}


def _cu(lengths, device="cpu"):
    return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)


def oracle(q, k, v, cu_q, cu_kv, *, scale, causal=False, left=None, right=None, bottom_right=True):
    """float64 attention of each packed sequence alone: query i of a sequence sees key j when
    i + shift - left <= j <= i + shift + right (None = unbounded; causal: right = 0), shift
    len_kv - len_q on a bottom-right diagonal, 0 on a top-left one; rows seeing no key are 0."""
    right = 0 if causal else right
    group = q.shape[1] // k.shape[1]
    outs = []
    for i in range(cu_q.numel() - 1):
        qi = q[int(cu_q[i]):int(cu_q[i + 1])].double().transpose(0, 1)
        ki, vi = (t[int(cu_kv[i]):int(cu_kv[i + 1])].double().transpose(0, 1).repeat_interleave(group, 0)
                  for t in (k, v))
        rows, cols = torch.arange(qi.shape[1])[:, None], torch.arange(ki.shape[1])[None, :]
        diag = rows + (ki.shape[1] - qi.shape[1] if bottom_right else 0)
        seen = torch.ones(rows.shape[0], cols.shape[1], dtype=torch.bool)
        if left is not None:
            seen &= cols >= diag - left
        if right is not None:
            seen &= cols <= diag + right
        scores = (qi @ ki.transpose(1, 2) * scale).masked_fill(~seen.to(qi.device), -math.inf)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        outs.append((probs @ vi).transpose(0, 1))
    return torch.cat(outs)


def _packed(lengths_q, lengths_kv, hq, hkv, d, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(sum(lengths_q), hq, d, generator=g, device=device).to(dtype)
    k = torch.randn(sum(lengths_kv), hkv, d, generator=g, device=device).to(dtype)
    v = torch.randn(sum(lengths_kv), hkv, d, generator=g, device=device).to(dtype)
    return q, k, v


def _assert_close_scaled(got, want, tol, what):
    scale = want.abs().max().clamp_min(1e-12)
    torch.testing.assert_close(got.double() / scale, want.double() / scale, rtol=tol, atol=tol,
                               msg=lambda m: f"{what}: {m}")


def _check_against_oracle(run, q, k, v, cu_q, cu_kv, semantics, seed):
    """run(q, k, v) -> out; compares out and dq, dk, dv with the oracle's."""
    got_in = [t.clone().requires_grad_() for t in (q, k, v)]
    want_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    got = run(*got_in)
    want = oracle(*want_in, cu_q.cpu(), cu_kv.cpu(), **semantics)
    assert got.shape == want.shape and got.dtype == q.dtype
    tol = TOL[q.dtype]
    _assert_close_scaled(got, want, tol, "out")
    g = torch.Generator(device=q.device).manual_seed(seed)
    dout = torch.randn(got.shape, generator=g, device=q.device).to(q.dtype)
    got.backward(dout)
    want.backward(dout.double())
    for name, a, b in zip("qkv", got_in, want_in):
        assert a.grad is not None and not a.grad.isnan().any(), f"d{name}"
        _assert_close_scaled(a.grad, b.grad, tol, f"d{name}")


# (name, attn_mask_type, op options, oracle semantics, (lengths_q, lengths_kv) or "self")
CASES = [
    ("padding", "padding", {}, dict(), "self"),
    ("padding-cross", "padding", {}, dict(), ([5, 40, 128, 1], [9, 40, 200, 7])),
    ("causal-top-left-self", "padding_causal", {}, dict(causal=True, bottom_right=False), "self"),
    ("causal-bottom-right", "padding_causal_bottom_right", {}, dict(causal=True), ([5, 40, 128, 1], [9, 40, 200, 7])),
    ("window-self", "padding", dict(window_size=(3, 2)), dict(left=3, right=2), "self"),
    ("window-cross", "padding", dict(window_size=(4, 0), bottom_right_diagonal=True), dict(left=4, right=0),
     ([5, 40, 128, 1], [9, 40, 200, 7])),
    ("causal-window", "padding_causal_bottom_right", dict(window_size=(5, 0)), dict(causal=True, left=5),
     ([5, 40, 128, 1], [9, 40, 200, 7])),
]
SELF_LENGTHS = [1, 17, 128, 300, 0, 64]


def _lengths(lengths):
    return (SELF_LENGTHS, SELF_LENGTHS) if lengths == "self" else lengths


# ---------------------------------------------------------------- on the CPU: supports() and the glue


@pytest.fixture
def cuda_mocked(monkeypatch):
    """CPU tensors pass for CUDA ones on a GPU of compute capability 9.0 with FlashAttention."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True, raising=False)


def _call(lengths_q, lengths_kv, hq=4, hkv=2, d=64, dtype=torch.bfloat16, same_offsets=False):
    q, k, v = _packed(lengths_q, lengths_kv, hq, hkv, d, dtype, "cpu", 0)
    cu_q = _cu(lengths_q)
    cu_kv = cu_q if same_offsets else _cu(lengths_kv)
    return (q, k, v, cu_q, cu_kv, max(lengths_q), max(lengths_kv))


def test_supports_declines_cpu_tensors():
    ok, why = varlen.supports_attention_varlen(*_call([3, 4], [3, 4]))
    assert not ok and "CUDA device" in why


@pytest.mark.parametrize("change, reason", [
    (dict(dtype=torch.float32), "float16 or bfloat16"),
    (dict(d=12), "multiple of 8 up to 256"),
    (dict(d=264), "multiple of 8 up to 256"),
    (dict(hq=3, hkv=2), "divides q's"),
])
def test_supports_declines_what_the_kernel_lacks(cuda_mocked, change, reason):
    ok, why = varlen.supports_attention_varlen(*_call([3, 4], [3, 4], **change))
    assert not ok and reason in why


@pytest.mark.parametrize("options, reason", [
    (dict(dropout_p=0.1), "dropout"),
    (dict(core_attention_bias_type="alibi"), "take no bias"),
    (dict(attn_mask_type="causal"), "not a padding type"),
])
def test_supports_declines_options(cuda_mocked, options, reason):
    ok, why = varlen.supports_attention_varlen(*_call([3, 4], [3, 4], same_offsets=True), **options)
    assert not ok and reason in why


@pytest.mark.parametrize("lengths_q, lengths_kv, options, reason", [
    ([3, 5], [4, 5], dict(attn_mask_type="padding_causal"), "top-left diagonal"),
    ([3, 5], [4, 5], dict(window_size=(2, 1), bottom_right_diagonal=False), "top-left diagonal"),
    ([4, 5], [3, 5], dict(attn_mask_type="padding_causal_bottom_right"), "more queries than keys"),
    ([4, 5], [3, 5], dict(window_size=(2, 1)), "more queries than keys"),
    ([4, 5], [0, 5], {}, "queries but no keys"),
    ([1, 1], [3, 5], {}, "max_seqlen_q == 1 with GQA"),
])
def test_supports_declines_lengths_the_kernel_would_get_wrong(cuda_mocked, lengths_q, lengths_kv, options, reason):
    ok, why = varlen.supports_attention_varlen(*_call(lengths_q, lengths_kv), **options)
    assert not ok and reason in why


@pytest.mark.parametrize("lengths_q, lengths_kv, options", [
    ([3, 5], [3, 5], dict(attn_mask_type="padding_causal")),  # top-left = bottom-right on equal lengths
    ([3, 5], [4, 5], dict(attn_mask_type="padding_causal_bottom_right", window_size=(2, 0))),
    ([4, 5], [3, 5], {}),  # no diagonal: every query sees every key of its sequence
    ([0, 5], [0, 5], dict(attn_mask_type="padding_causal")),  # an empty sequence
])
def test_supports_accepts(cuda_mocked, lengths_q, lengths_kv, options):
    assert varlen.supports_attention_varlen(*_call(lengths_q, lengths_kv), **options) == (True, "")
    assert varlen.supports_attention_varlen(*_call(lengths_q, lengths_q, same_offsets=True), **options) == (True, "")


def _flash_semantics(is_causal, window_size_left, window_size_right, scale):
    """The oracle's arguments for FlashAttention-2's documented semantics: a bottom-right
    diagonal, None or -1 = unbounded window side, is_causal = right side 0."""
    unbounded = (None, -1)
    return dict(scale=scale, causal=is_causal, left=None if window_size_left in unbounded else window_size_left,
                right=None if window_size_right in unbounded else window_size_right)


def _emulated_forward(q, k, v, cu_q, cu_kv, max_q, max_kv, dropout_p, is_causal, return_debug_mask, *, scale,
                      window_size_left=None, window_size_right=None):
    """torch's varlen forward in float64 (GQA without repeated heads, as the kernel takes it)."""
    assert cu_q.dtype == cu_kv.dtype == torch.int32 and dropout_p == 0.0 and not return_debug_mask
    assert max_q == int(cu_q.diff().max()) and max_kv == int(cu_kv.diff().max())
    with torch.no_grad():
        out = oracle(q, k, v, cu_q, cu_kv, **_flash_semantics(is_causal, window_size_left, window_size_right, scale))
    empty = torch.empty(0)
    return out.to(q.dtype), empty, empty, empty, empty


def _emulated_backward(dout, q, k, v, out, lse, cu_q, cu_kv, max_q, max_kv, dropout_p, is_causal, rng_state,
                       unused, *, scale, window_size_left=None, window_size_right=None):
    """torch's varlen backward in float64: (dq, dk, dv) in the inputs' dtypes."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        again = oracle(*leaves, cu_q, cu_kv, **_flash_semantics(is_causal, window_size_left, window_size_right, scale))
        grads = torch.autograd.grad(again, leaves, dout.double())
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


@pytest.mark.parametrize("name, mask_type, options, semantics, lengths", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (4, 1)])
def test_glue_matches_the_reference_with_emulated_kernels(monkeypatch, name, mask_type, options, semantics, lengths,
                                                          hq, hkv):
    """What attention_varlen passes to the kernels, checked with the kernels emulated in float64."""
    monkeypatch.setattr(varlen, "_flash_forward", _emulated_forward)
    monkeypatch.setattr(varlen, "_flash_backward", _emulated_backward)
    lengths_q, lengths_kv = ([min(n, 40) for n in ns] for ns in _lengths(lengths))  # short: float64 on the CPU
    q, k, v = _packed(lengths_q, lengths_kv, hq, hkv, 16, torch.float32, "cpu", 1)
    cu_q = _cu(lengths_q)
    cu_kv = cu_q if lengths == "self" else _cu(lengths_kv)
    args = (cu_q, cu_kv, max(lengths_q), max(lengths_kv))
    kwargs = dict(attn_mask_type=mask_type, softmax_scale=0.3, **options)
    got_in = [t.clone().requires_grad_() for t in (q, k, v)]
    want_in = [t.clone().requires_grad_() for t in (q, k, v)]
    got = varlen.attention_varlen(*got_in, *args, **kwargs)
    want = ref.attention_varlen(*want_in, *args, **kwargs)
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
    dout = torch.randn(got.shape, generator=torch.Generator().manual_seed(2))
    got.backward(dout)
    want.backward(dout)
    for a, b in zip(got_in, want_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1.3e-6, atol=1e-5)


def test_flash_window_follows_the_contract():
    assert varlen.flash_window("padding", None) == (False, None, None)
    assert varlen.flash_window("padding_causal", None) == (True, None, 0)
    assert varlen.flash_window("padding", (3, 2)) == (False, 3, 2)
    assert varlen.flash_window("padding_causal_bottom_right", (5, 0)) == (True, 5, 0)


# ---------------------------------------------------------------- on the GPU: the kernels


@needs_gpu
@pytest.mark.parametrize("name, mask_type, options, semantics, lengths", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("hq, hkv", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 64), (torch.float16, 128)])
def test_kernels_match_float64(name, mask_type, options, semantics, lengths, hq, hkv, dtype, d):
    lengths_q, lengths_kv = _lengths(lengths)
    q, k, v = _packed(lengths_q, lengths_kv, hq, hkv, d, dtype, "cuda", 3)
    cu_q = _cu(lengths_q, "cuda")
    cu_kv = cu_q if lengths == "self" else _cu(lengths_kv, "cuda")
    args = (cu_q, cu_kv, max(lengths_q), max(lengths_kv))
    kwargs = dict(attn_mask_type=mask_type, softmax_scale=0.125, **options)
    ok, why = varlen.supports_attention_varlen(q, k, v, *args, **kwargs)
    assert ok, why
    _check_against_oracle(lambda q, k, v: varlen.attention_varlen(q, k, v, *args, **kwargs), q, k, v, cu_q, cu_kv,
                          dict(scale=0.125, **semantics), seed=4)


@needs_gpu
def test_declined_call_falls_back_with_its_reason():
    """float32: the reference runs, with the cuda backend's reason in the fallback warning."""
    from te_core import backend, ops

    lengths = [7, 20, 3]
    q, k, v = _packed(lengths, lengths, 4, 2, 32, torch.float32, "cuda", 5)
    cu = _cu(lengths, "cuda")
    ok, why = varlen.supports_attention_varlen(q, k, v, cu, cu, 20, 20, attn_mask_type="padding_causal")
    assert not ok and "float16 or bfloat16" in why
    backend.set_backend("cuda")
    try:
        with warnings.catch_warnings():  # the fallback warns once per process, maybe in an earlier test
            warnings.simplefilter("ignore", backend.BackendFallbackWarning)
            _check_against_oracle(
                lambda q, k, v: ops.attention_varlen(q, k, v, cu, cu, 20, 20, attn_mask_type="padding_causal"),
                q, k, v, cu, cu, dict(scale=32 ** -0.5, causal=True), seed=6)
    finally:
        backend.set_backend("reference")


@needs_gpu
@pytest.mark.parametrize("mask_type", ["padding_causal", "padding_causal_bottom_right", "no_mask"])
def test_dot_product_attention_thd_runs_natively(monkeypatch, mask_type):
    """DotProductAttention(qkv_format="thd") on CUDA tensors reaches the varlen kernels: with
    TE_BACKEND_STRICT=1 a fallback would raise."""
    import te_core.modules as tm
    from te_core import backend

    monkeypatch.setenv("TE_BACKEND_STRICT", "1")
    backend.set_backend("cuda")
    try:
        lengths = [33, 1, 250, 64]
        q, k, v = _packed(lengths, lengths, 8, 2, 64, torch.bfloat16, "cuda", 7)
        cu = _cu(lengths, "cuda")
        dpa = tm.DotProductAttention(8, 64, num_gqa_groups=2, qkv_format="thd", attn_mask_type=mask_type)
        causal = mask_type != "no_mask"
        _check_against_oracle(
            lambda q, k, v: dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu).view(q.shape[0], 8, 64),
            q, k, v, cu, cu, dict(scale=64 ** -0.5, causal=causal), seed=8)
    finally:
        backend.set_backend("reference")


@needs_gpu
def test_no_padding_is_computed():
    """One long and three short sequences: the padded batch's float32 scores alone would take
    b * h * s_max^2 * 4 bytes (4 GiB here); the varlen kernels' memory grows with the tokens."""
    lengths = [8192] + [16] * 3
    q, k, v = (t.requires_grad_() for t in _packed(lengths, lengths, 4, 4, 64, torch.bfloat16, "cuda", 9))
    cu = _cu(lengths, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = varlen.attention_varlen(q, k, v, cu, cu, 8192, 8192, attn_mask_type="padding_causal")
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert peak < 256 * 2 ** 20, f"peak {peak / 2 ** 20:.0f} MiB: padding was computed"


def test_supports_declines_offsets_it_cannot_read(cuda_mocked, monkeypatch):
    """Under torch.compile or graph capture the offsets cannot be read on the host: query and key
    offsets given apart (whose lengths the kernel might get wrong) are declined, naming why, and
    the reference computes them; one tensor given as both still runs on the kernel."""
    monkeypatch.setattr(varlen, "host_readable", lambda t: False)
    ok, why = varlen.supports_attention_varlen(*_call([3, 5], [3, 5]), attn_mask_type="padding_causal")
    assert not ok and "torch.compile or graph capture" in why
    same = varlen.supports_attention_varlen(*_call([3, 5], [3, 5], same_offsets=True), attn_mask_type="padding_causal")
    assert same == (True, "")
