"""The SDPA-based attention against the reference, on the CPU (SDPA's math kernel): every mask
type, GQA, fully masked rows, gradients; and the backend-choice variable."""
import pytest
import torch
from te_backend_cuda import attention
from te_core.reference import attention as ref

MASKS = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "arbitrary")


def _qkv(b, hq, hkv, sq, sk, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g, dtype=torch.float32)
    k = torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float32)
    v = torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float32)
    return q, k, v


def _mask(kind, b, hq, sq, sk, seed):
    g = torch.Generator().manual_seed(seed)
    if kind in ("padding", "padding_causal"):
        m = torch.zeros(b, 1, 1, sk, dtype=torch.bool)
        m[0, ..., sk - 2:] = True
        m[-1, ..., :] = True  # a batch whose every key is padding: all rows masked -> zeros
        return m
    if kind == "arbitrary":
        return torch.rand(b, hq, sq, sk, generator=g) > 0.6
    return None


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("sq,sk", [(5, 5), (3, 6), (6, 3)])
def test_matches_reference_with_grads(kind, sq, sk):
    b, hq, hkv, d = 2, 4, 2, 8
    q, k, v = _qkv(b, hq, hkv, sq, sk, d, 1)
    mask = _mask(kind, b, hq, sq, sk, 2)
    got_in = [t.clone().requires_grad_() for t in (q, k, v)]
    want_in = [t.clone().requires_grad_() for t in (q, k, v)]
    got = attention.attention(*got_in, attn_mask_type=kind, attention_mask=mask, softmax_scale=0.3)
    want = ref.attention(*want_in, attn_mask_type=kind, attention_mask=mask, softmax_scale=0.3)
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
    dout = torch.randn(got.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float32)
    got.backward(dout)
    want.backward(dout)
    for g_t, w_t in zip(got_in, want_in):
        assert not g_t.grad.isnan().any()
        torch.testing.assert_close(g_t.grad, w_t.grad, rtol=1.3e-6, atol=1e-5)


def test_backend_order_from_environment(monkeypatch):
    from torch.nn.attention import SDPBackend

    monkeypatch.setenv(attention.ENV, "math")
    assert attention._backend_list()[0] == SDPBackend.MATH
    monkeypatch.delenv(attention.ENV)
    assert attention._backend_list()[0] == SDPBackend.CUDNN_ATTENTION
    monkeypatch.setenv(attention.ENV, "fast")
    with pytest.raises(ValueError, match="TE_CUDA_ATTENTION_BACKEND='fast' is not an SDPA backend"):
        attention._backend_list()


def test_errors_name_the_problem():
    q, k, v = _qkv(1, 3, 2, 4, 4, 8, 4)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention.attention(q, k, v)
    q, k, v = _qkv(1, 2, 2, 4, 4, 8, 4)
    with pytest.raises(ValueError, match="needs attention_mask"):
        attention.attention(q, k, v, attn_mask_type="padding")


def _padding_pair(b, sq, sk):
    """Right-padded keys and queries, a different length per sequence."""
    kv = torch.arange(sk)[None, :] >= torch.tensor([sk, max(sk - 2, 1)])[:b, None]
    q = torch.arange(sq)[None, :] >= torch.tensor([max(sq - 1, 1), sq])[:b, None]
    return kv.view(b, 1, 1, sk), q.view(b, 1, 1, sq)


EXTENDED = [
    dict(attn_mask_type="padding_causal_bottom_right", padded=True),
    dict(attn_mask_type="padding", padded=True, window_size=(1, 1)),
    dict(attn_mask_type="causal", window_size=(2, 0)),
    dict(attn_mask_type="causal_bottom_right", window_size=(1, 0)),
    dict(attn_mask_type="no_mask", window_size=(1, 2), bottom_right_diagonal=False),
    dict(attn_mask_type="no_mask", core_attention_bias_type="post_scale_bias"),
    dict(attn_mask_type="causal", core_attention_bias_type="pre_scale_bias"),
    dict(attn_mask_type="no_mask", core_attention_bias_type="alibi"),
    dict(attn_mask_type="padding_causal", padded=True, core_attention_bias_type="alibi", window_size=(2, 0)),
]


@pytest.mark.parametrize("case", EXTENDED, ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("sq,sk", [(5, 5), (4, 6)])
def test_windows_padding_and_bias_match_reference(case, sq, sk):
    """Explicit masks and float biases through SDPA give the reference's values and gradients
    (the bias itself needs no gradient here: supports() declines one that does)."""
    b, hq, hkv, d = 2, 4, 2, 8
    case = dict(case)
    q, k, v = _qkv(b, hq, hkv, sq, sk, d, 5)
    if case.pop("padded", False):
        case["attention_mask"], case["query_padding_mask"] = _padding_pair(b, sq, sk)
    if case.get("core_attention_bias_type", "").endswith("scale_bias"):
        case["core_attention_bias"] = torch.randn(1, hq, sq, sk, generator=torch.Generator().manual_seed(6))
    got_in = [t.clone().requires_grad_() for t in (q, k, v)]
    want_in = [t.clone().requires_grad_() for t in (q, k, v)]
    got = attention.attention(*got_in, softmax_scale=0.3, **case)
    want = ref.attention(*want_in, softmax_scale=0.3, **case)
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
    dout = torch.randn(got.shape, generator=torch.Generator().manual_seed(7))
    got.backward(dout)
    want.backward(dout)
    for g_t, w_t in zip(got_in, want_in):
        torch.testing.assert_close(g_t.grad, w_t.grad, rtol=1.3e-6, atol=1e-5)


def test_supports_declines_a_bias_that_needs_a_gradient(monkeypatch):
    q, k, v = _qkv(1, 2, 2, 4, 4, 8, 8)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    bias = torch.zeros(1, 2, 4, 4, requires_grad=True)
    ok, reason = attention.supports_attention(q, k, v, core_attention_bias_type="post_scale_bias",
                                              core_attention_bias=bias)
    assert not ok and "gradient" in reason
    assert attention.supports_attention(q, k, v, core_attention_bias_type="post_scale_bias",
                                        core_attention_bias=bias.detach()) == (True, "")


@pytest.mark.parametrize("kind", ["causal", "padding"])
def test_compiles_whole_on_views_of_a_fused_projection(kind):
    """Under torch.compile(fullgraph=True) the attention traces whole (a trace cannot read a
    view's storage offset, so the layout rule asks nothing of it there) on q, k and v sliced from
    one fused projection, as a layer hands them over, and gives the eager result."""
    g = torch.Generator().manual_seed(7)
    b, h, s, d = 2, 3, 8, 16
    fused = torch.randn(b, s, 3 * h * d + 2, generator=g)
    mask = _mask(kind, b, h, s, s, 7)

    def run(x):
        q, k, v = (x[..., 1 + i * h * d: 1 + (i + 1) * h * d].reshape(b, s, h, d).transpose(1, 2) for i in range(3))
        return attention.attention(q, k, v, attn_mask_type=kind, attention_mask=mask)

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(run, fullgraph=True)(fused), run(fused), rtol=1.3e-6, atol=1e-5)


def test_a_layer_compiles_whole_with_this_attention(monkeypatch):
    """A TransformerLayer under torch.compile(fullgraph=True) running this module's attention (on
    a CPU backend built as twin_backends builds one, whose attention is this one): the trace,
    which runs a differentiable op's implementation inline, takes the layout rule whole, and the
    compiled step gives the eager output and gradients."""
    import te_core as te
    from te_core.reference import plugin as ref_plugin
    from twin_backends import cpu_backend_with

    reference_ops = ref_plugin.implementations
    monkeypatch.setattr(ref_plugin, "implementations", lambda: {**reference_ops(), "attention": attention.attention})

    g = torch.Generator().manual_seed(11)
    x = torch.randn(8, 2, 64, generator=g, requires_grad=True)
    dy = torch.randn(8, 2, 64, generator=g)
    with cpu_backend_with(monkeypatch, "cpu_cuda_attention", {}):
        torch.manual_seed(0)
        layer = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                    self_attn_mask_type="causal", params_dtype=torch.float32)
        results = []
        for run in (layer, torch.compile(layer, fullgraph=True)):
            x.grad = None
            layer.zero_grad(set_to_none=True)
            y = run(x)
            y.backward(dy)
            results.append((y.detach(), x.grad.clone(), layer.self_attention.layernorm_qkv.weight.grad.clone()))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
