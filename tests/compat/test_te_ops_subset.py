"""The part of Transformer Engine's fusible-operation API its Mixtral tutorials use
(transformer_engine.pytorch.ops: GroupedLinear, Sequential, SwiGLU, ScaledSwiGLU) and their
attention.inference import, through the stand-in: forward and every gradient against a float64
computation, under te.autocast against te-core's own GroupedLinear, TE's parameter and state-dict
names, and the errors of bad inputs."""
from __future__ import annotations

import pytest
import torch

import te_core
from te_core.recipe import DelayedScaling

FP32 = dict(rtol=1.3e-6, atol=1e-5)
BF16 = dict(rtol=1.6e-2, atol=1e-5)
E4M3 = dict(rtol=0.125, atol=0.0675)
E5M2 = dict(rtol=0.25, atol=0.125)
GROUPS, HIDDEN, FFN = 4, 24, 20
SPLITS = [5, 0, 9, 3]  # one expert without tokens


def _experts(ops, bias: bool, activation=None):
    """The tutorial's expert FFN: gate_up, the activation (SwiGLU unless given), down, every
    GroupedLinear over GROUPS experts."""
    gate_up = ops.GroupedLinear(GROUPS, HIDDEN, 2 * FFN, bias=bias)
    down = ops.GroupedLinear(GROUPS, FFN, HIDDEN, bias=bias)
    return ops.Sequential(gate_up, activation or ops.SwiGLU(), down)


def _params(linear, kind: str):
    return [getattr(linear, f"{kind}{i}") for i in range(linear.num_groups)]


def _swiglu(h, interleave=None):
    """silu(a) * b, with silu as x sigmoid(x) (the formula of te-core's reference activation);
    with `interleave`, h alternates blocks of that many gate (a) and linear (b) columns."""
    if interleave:
        blocks = h.reshape(*h.shape[:-1], -1, 2, interleave)
        a, b = blocks[..., 0, :].flatten(-2), blocks[..., 1, :].flatten(-2)
    else:
        a, b = h.chunk(2, dim=-1)
    return a * torch.sigmoid(a) * b


def _float64_experts(x, splits, seq, bias: bool, probs=None):
    """(y, leaves) of the expert FFN in float64 autograd, on float64 copies of seq's parameters
    (and of probs, which scale the activation's rows, the last leaf)."""
    gate_up, activation, down = seq
    leaves = [p.detach().double().requires_grad_() for m in (gate_up, down) for p in m.parameters()]
    x64 = x.detach().double().requires_grad_()
    n = len(leaves) // 2
    w1, b1 = leaves[:GROUPS], leaves[GROUPS:n] if bias else [0.0] * GROUPS
    w2, b2 = leaves[n:n + GROUPS], leaves[n + GROUPS:] if bias else [0.0] * GROUPS
    rows = x64.reshape(-1, HIDDEN).split(splits)
    h = _swiglu(torch.cat([r @ w1[g].T + b1[g] for g, r in enumerate(rows)]), activation.glu_interleave_size)
    if probs is not None:
        leaves.append(probs.detach().double().requires_grad_())
        h = h * leaves[-1].reshape(-1, 1)
    y = torch.cat([r @ w2[g].T + b2[g] for g, r in enumerate(h.split(splits))])
    return y.reshape(*x.shape[:-1], HIDDEN), [x64] + leaves


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("shape", [(17, HIDDEN), (1, 17, HIDDEN)], ids=["2d", "3d"])
def test_experts_match_float64(stand_in, bias, shape):
    """Sequential(GroupedLinear, SwiGLU, GroupedLinear)(x, splits, splits), splits an int32
    tensor as the tutorial passes them: output and the gradients of x, every weight and bias."""
    from transformer_engine.pytorch import ops

    torch.manual_seed(0)
    seq = _experts(ops, bias)
    if bias:  # (TE initializes them to zero: random ones test that they are added)
        with torch.no_grad():
            for p in seq.parameters():
                if p.dim() == 1:
                    p.normal_()
    x = torch.randn(shape, requires_grad=True)
    splits = torch.tensor(SPLITS, dtype=torch.int32)
    y = seq(x, splits, splits)
    want, leaves = _float64_experts(x, SPLITS, seq, bias)
    torch.testing.assert_close(y.double(), want, **FP32)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy.double())
    got = [x] + [p for m in (seq[0], seq[2]) for p in m.parameters()]
    for tensor, leaf in zip(got, leaves, strict=True):
        torch.testing.assert_close(tensor.grad.double(), leaf.grad, **FP32)
    assert not seq[0].weight1.grad.any()  # the expert without tokens


def test_interleaved_swiglu_matches_float64(stand_in):
    """glu_interleave_size=k: the input alternates k gate columns and k linear columns."""
    from transformer_engine.pytorch.ops import SwiGLU

    k, x = 4, torch.randn(7, 3 * 2 * 4, requires_grad=True)
    y = SwiGLU(glu_interleave_size=k)(x)
    x64 = x.detach().double().requires_grad_()
    blocks = x64.reshape(7, 3, 2, k)
    want = torch.nn.functional.silu(blocks[:, :, 0]).mul(blocks[:, :, 1]).reshape(7, 3 * k)
    torch.testing.assert_close(y.double(), want, **FP32)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, **FP32)


def test_under_delayed_scaling_runs_te_cores_grouped_linear(stand_in):
    """Under te.autocast(DelayedScaling()) the operations' GEMMs are te.GroupedLinear's: two
    training steps against two te.GroupedLinear modules of the same weights with a SwiGLU
    between; the first forward is bitwise the same, the rest within E4M3's tolerances, and the
    output is FP8's, not the high-precision one."""
    from transformer_engine.pytorch import ops

    torch.manual_seed(1)
    seq = _experts(ops, bias=True)
    gate_up = te_core.GroupedLinear(GROUPS, HIDDEN, 2 * FFN)
    down = te_core.GroupedLinear(GROUPS, FFN, HIDDEN)
    with torch.no_grad():
        for op, module in ((seq[0], gate_up), (seq[2], down)):
            for name, p in op.named_parameters():
                p.normal_(std=0.2 if name.startswith("weight") else 0.5)
                getattr(module, name).copy_(p)
    splits = torch.tensor(SPLITS, dtype=torch.int32)
    for step in range(2):
        x = torch.randn(17, HIDDEN)
        x_ops, x_own = x.clone().requires_grad_(), x.clone().requires_grad_()
        with te_core.autocast(recipe=DelayedScaling()):
            y = seq(x_ops, splits, splits)
            want = down(_swiglu(gate_up(x_own, SPLITS)), SPLITS)
        if step == 0:
            assert torch.equal(y, want)
            with torch.no_grad():
                high = seq(x, splits, splits)
            assert not torch.allclose(y, high, **FP32)  # FP8 GEMMs ran
        torch.testing.assert_close(y, want, **E4M3)
        dy = torch.randn_like(y)
        y.backward(dy)
        want.backward(dy)
        torch.testing.assert_close(x_ops.grad, x_own.grad, **E4M3)
        for op, module in ((seq[0], gate_up), (seq[2], down)):
            for name, p in op.named_parameters():
                torch.testing.assert_close(p.grad, getattr(module, name).grad, **E4M3)


def test_parameter_and_state_dict_names_are_transformer_engines(stand_in):
    """weight0..N-1 then bias0..N-1 per GroupedLinear, (out, in) weights, an _extra_state for
    every operation (SwiGLU's empty), no bias entries with bias=False; TE's init (kaiming
    uniform weights within 1/sqrt(in_features), zero biases); a state dict round trip."""
    from transformer_engine.pytorch import ops

    seq = _experts(ops, bias=True)
    weights = [f"weight{i}" for i in range(GROUPS)]
    biases = [f"bias{i}" for i in range(GROUPS)]
    assert [n for n, _ in seq.named_parameters()] == [f"{m}.{p}" for m in (0, 2) for p in weights + biases]
    assert list(seq.state_dict()) == ([f"0.{p}" for p in weights + biases] + ["0._extra_state", "1._extra_state"]
                                      + [f"2.{p}" for p in weights + biases] + ["2._extra_state"])
    assert seq.state_dict()["1._extra_state"].numel() == 0
    assert seq[0].weight3.shape == (2 * FFN, HIDDEN) and seq[2].bias0.shape == (HIDDEN,)
    assert list(ops.GroupedLinear(2, 8, 8, bias=False).state_dict()) == ["weight0", "weight1", "_extra_state"]
    wide = ops.GroupedLinear(2, 1024, 4)
    assert wide.weight0.abs().max() <= 1024 ** -0.5 and wide.weight0.std() > 0.5 * 1024 ** -0.5 / 3 ** 0.5
    assert not wide.bias1.any()
    copy = _experts(ops, bias=True)
    copy.load_state_dict(seq.state_dict())
    x, splits = torch.randn(17, HIDDEN), torch.tensor(SPLITS)
    assert torch.equal(copy(x, splits, splits), seq(x, splits, splits))


def test_meta_device_then_reset_parameters(stand_in):
    """The tutorial builds its experts on the meta device and calls reset_parameters()."""
    from transformer_engine.pytorch.ops import GroupedLinear

    op = GroupedLinear(GROUPS, HIDDEN, FFN, bias=False, device="meta")
    assert op.weight0.is_meta
    op.reset_parameters()
    x = torch.randn(17, HIDDEN)
    want = torch.cat([r.double() @ w.double().T for r, w in zip(x.split(SPLITS), _params(op, "weight"))])
    torch.testing.assert_close(op(x, torch.tensor(SPLITS)).double(), want, **FP32)


def test_left_on_meta_initializes_at_first_forward(stand_in):
    """As in Transformer Engine (and as the other operations do): a GroupedLinear built on meta and
    never reset initializes its parameters at its first forward (kaiming uniform weights, zero
    biases), keeping TE's parameter order; the output is float64's with those weights."""
    from transformer_engine.pytorch.ops import GroupedLinear

    torch.manual_seed(6)
    op = GroupedLinear(GROUPS, HIDDEN, FFN, device="meta")
    x = torch.randn(17, HIDDEN)
    y = op(x, torch.tensor(SPLITS))
    assert not any(p.is_meta for p in op.parameters())
    assert list(op.state_dict()) == [f"weight{i}" for i in range(GROUPS)] + [f"bias{i}" for i in range(GROUPS)] + [
        "_extra_state"]
    bound = HIDDEN ** -0.5
    assert all(w.abs().max() <= bound and w.std() > 0.5 * bound / 3 ** 0.5 for w in _params(op, "weight"))
    assert not any(b.any() for b in _params(op, "bias"))
    want = torch.cat([r.double() @ w.double().T for r, w in zip(x.split(SPLITS), _params(op, "weight"))])
    torch.testing.assert_close(y.double(), want, **FP32)


@pytest.mark.parametrize("mode", ["accumulate_into_main_grad", "delay_wgrad_compute"])
def test_weight_gradient_options(stand_in, mode):
    """accumulate_into_main_grad: the weight gradients add into main_grad (grad stays None);
    delay_wgrad_compute: they wait for backward_dw(). Either way they equal float64's."""
    from transformer_engine.pytorch.ops import GroupedLinear

    op = GroupedLinear(GROUPS, HIDDEN, FFN, bias=False, **{mode: True})
    start = [torch.randn_like(w) for w in op.parameters()]
    for w, main in zip(op.parameters(), start):
        w.main_grad = main.clone()
    x, dy = torch.randn(17, HIDDEN), torch.randn(17, FFN)
    op(x, torch.tensor(SPLITS)).backward(dy)
    if mode == "delay_wgrad_compute":
        assert op.weight0.grad is None
        op.backward_dw()
    for g, (w, x_g, dy_g) in enumerate(zip(op.parameters(), x.split(SPLITS), dy.split(SPLITS))):
        want = dy_g.double().T @ x_g.double()
        got = w.grad if mode == "delay_wgrad_compute" else w.main_grad - start[g]
        assert (w.grad is None) == (mode == "accumulate_into_main_grad")
        torch.testing.assert_close(got.double(), want, **FP32)


def test_bad_inputs_say_what_is_wrong(stand_in):
    from transformer_engine.pytorch import ops

    seq, x = _experts(ops, bias=False), torch.randn(17, HIDDEN)
    with pytest.raises(ValueError, match=r"split sizes \[5, 0, 9, 2\] sum to 16 but the input has 17 rows"):
        seq(x, torch.tensor([5, 0, 9, 2]), torch.tensor(SPLITS))
    with pytest.raises(ValueError, match=r"expected 4 split sizes \(one per group, num_groups=4\), got 3"):
        seq(x, torch.tensor([5, 9, 3]), torch.tensor([5, 9, 3]))
    with pytest.raises(ValueError, match="non-negative"):
        seq[0](x, torch.tensor([6, -1, 9, 3]))
    with pytest.raises(TypeError, match="1-D integer tensor"):
        seq[0](x, torch.tensor(SPLITS, dtype=torch.float32))
    with pytest.raises(TypeError, match=r"takes the input and 2 extra input\(s\) \(1 for the GroupedLinear at '0', "
                                        r"1 for the GroupedLinear at '2'\).*got 1"):
        seq(x, torch.tensor(SPLITS))
    with pytest.raises(TypeError, match=r"ops.GroupedLinear: takes the input and 1 extra input"):
        seq[0](x)
    with pytest.raises(ValueError, match=r"input has shape \(17, 32\); its last dimension must be 24"):
        seq[0](torch.randn(17, 32), torch.tensor(SPLITS))
    with pytest.raises(ValueError, match="last dimension must be a positive multiple of 2"):
        ops.SwiGLU()(torch.randn(3, 5))
    with pytest.raises(ValueError, match="multiple of 2 \\* glu_interleave_size = 8"):
        ops.SwiGLU(glu_interleave_size=4)(torch.randn(3, 12))
    with pytest.raises(TypeError, match="ops.SwiGLU.*cache_quantized_input"):
        ops.SwiGLU(cache_quantized_input="yes")
    with pytest.raises(ValueError, match="glu_interleave_size must be a positive int or None, got 0"):
        ops.SwiGLU(glu_interleave_size=0)
    with pytest.raises(TypeError, match=r"takes the input and 2 extra input\(s\) .*with scale_bias=True, one bias "
                                        r"scale per input row\), got 1"):
        ops.GroupedLinear(2, 8, 8, scale_bias=True)(torch.randn(3, 8), torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="dtype must be"):
        ops.GroupedLinear(2, 8, 8, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="op_kwargs"):
        seq(x, torch.tensor(SPLITS), torch.tensor(SPLITS), op_kwargs={0: {"output": torch.empty(17, 2 * FFN)}})
    # TE's buffer names, said as given (not te-core GroupedLinear's out=, nor its FP8 reason)
    with pytest.raises(NotImplementedError, match=r"ops.GroupedLinear: caller-provided buffers \(grad_input, "
                                                  r"output\) are not supported"):
        seq[0](x, torch.tensor(SPLITS), output=torch.empty(17, 2 * FFN), grad_input=torch.empty(17, HIDDEN))
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['out'\]"):
        seq[0](x, torch.tensor(SPLITS), out=torch.empty(17, 2 * FFN))
    torch.testing.assert_close(seq[0](x, torch.tensor(SPLITS), output=None), seq[0](x, torch.tensor(SPLITS)),
                               rtol=0, atol=0)


def test_the_tutorials_imports_resolve(stand_in):
    """te_mixtral.py's imports; PagedKVCacheManager is importable and says what to use when
    built; the rest of TE's fusible-operation API keeps explaining itself."""
    from transformer_engine.pytorch.attention import InferenceParams
    from transformer_engine.pytorch.attention.inference import InferenceParams as from_inference
    from transformer_engine.pytorch.attention.inference import PagedKVCacheManager
    from transformer_engine.pytorch.ops import GroupedLinear, ScaledSwiGLU, Sequential, SwiGLU

    from te_core.modules import fusible_ops

    assert (GroupedLinear, Sequential, SwiGLU, ScaledSwiGLU) == (
        fusible_ops.GroupedLinear, fusible_ops.Sequential, fusible_ops.SwiGLU, fusible_ops.ScaledSwiGLU)
    assert not issubclass(ScaledSwiGLU, SwiGLU)  # (nor in TE: code telling them apart keeps working)
    assert InferenceParams is from_inference is te_core.InferenceParams
    assert issubclass(GroupedLinear, te_core.GroupedLinear)
    with pytest.raises(NotImplementedError, match=r"InferenceParams\(2, 64, num_heads_kv=4, .*is_paged=True, "
                                                  r"total_num_pages=8, page_size=16\)"):
        PagedKVCacheManager(8, 16, 4, 32, torch.bfloat16, 2, 64)
    with pytest.raises(ImportError, match="Sequential, Linear, the basic operations .*not its fused operations"):
        from transformer_engine.pytorch.ops import fused  # noqa: F401
    with pytest.raises(ImportError, match="holds, and with is_paged=True pages, the KV caches itself"):
        from transformer_engine.pytorch.attention.inference import NonPagedKVCacheManager  # noqa: F401


# ScaledSwiGLU: TE's MXFP8 Mixtral tutorial scales the SwiGLU rows by the routing probabilities.

@pytest.mark.parametrize("interleave", [None, 32], ids=["halves", "interleaved"])
@pytest.mark.parametrize("shape", [(13, 128), (3, 5, 128)], ids=["2d", "3d"])
def test_scaled_swiglu_matches_float64(stand_in, interleave, shape):
    """swiglu(x) * probs[..., None], probs shaped as x without its last dimension (TE's
    documented shape); the gradients of x and of probs. 64 output columns in blocks of 32: the
    tutorial's interleave, two blocks, so a layout mix-up changes the result."""
    from transformer_engine.pytorch.ops import ScaledSwiGLU

    torch.manual_seed(2)
    x = torch.randn(shape, requires_grad=True)
    probs = torch.rand(shape[:-1], requires_grad=True)
    y = ScaledSwiGLU(glu_interleave_size=interleave)(x, probs)
    x64, p64 = x.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    want = _swiglu(x64, interleave) * p64.unsqueeze(-1)
    assert y.shape == (*shape[:-1], 64)
    torch.testing.assert_close(y.double(), want, **FP32)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, **FP32)
    torch.testing.assert_close(probs.grad.double(), p64.grad, **FP32)


def test_scaled_swiglu_bfloat16_input_float32_probs(stand_in):
    """As in the tutorial: a bfloat16 input, float32 probs (a softmax's). The output is the
    input's dtype, probs get a float32 gradient of their own shape ((rows, 1) here: TE takes any
    shape of one value per row); with probs that need no gradient the input still gets its own."""
    from transformer_engine.pytorch.ops import ScaledSwiGLU

    torch.manual_seed(3)
    op = ScaledSwiGLU(32)  # (positional, as TE's signature allows)
    x = torch.randn(13, 128, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(13, 1, requires_grad=True)
    y = op(x, probs)
    x64, p64 = x.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    want = _swiglu(x64, 32) * p64
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), want, **BF16)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy.double())
    assert probs.grad.dtype == torch.float32 and probs.grad.shape == (13, 1)
    torch.testing.assert_close(x.grad.double(), x64.grad, **BF16)
    torch.testing.assert_close(probs.grad.double(), p64.grad, **BF16)
    x.grad = None
    op(x, probs.detach()).backward(dy)
    torch.testing.assert_close(x.grad.double(), x64.grad, **BF16)


@pytest.mark.parametrize("interleave", [None, 5], ids=["halves", "interleaved"])
def test_experts_with_scaled_swiglu_match_float64(stand_in, interleave):
    """The MXFP8 tutorial's call: Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)(x,
    split_sizes, probs, split_sizes), the extra inputs in the order of the operations; output and
    the gradients of x, every weight and probs; TE's state-dict keys (ScaledSwiGLU's empty
    _extra_state)."""
    from transformer_engine.pytorch import ops

    torch.manual_seed(4)
    seq = _experts(ops, bias=False, activation=ops.ScaledSwiGLU(glu_interleave_size=interleave))
    x, probs = torch.randn(17, HIDDEN, requires_grad=True), torch.rand(17, requires_grad=True)
    splits = torch.tensor(SPLITS, dtype=torch.int32)
    y = seq(x, splits, probs, splits)
    want, leaves = _float64_experts(x, SPLITS, seq, bias=False, probs=probs)
    torch.testing.assert_close(y.double(), want, **FP32)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy.double())
    got = [x] + list(seq[0].parameters()) + list(seq[2].parameters()) + [probs]
    for tensor, leaf in zip(got, leaves, strict=True):
        torch.testing.assert_close(tensor.grad.double(), leaf.grad, **FP32)
    assert "1._extra_state" in seq.state_dict() and seq.state_dict()["1._extra_state"].numel() == 0


def _on_fp8_grid(t, splits=None, fp8_dtype=torch.float8_e4m3fn):
    """t rounded to the values an FP8 cast under DelayedScaling's first scale (fp8_max / amax)
    represents exactly, as Transformer Engine's tests make their operands; with `splits`, each row
    group first gets t's amax, so that per-group casts use the same scale."""
    t = t.clone()
    if splits is not None:
        starts = torch.tensor([0] + splits[:-1]).cumsum(0)[torch.tensor(splits) > 0]
        t[starts, 0] = t.abs().max()
    scale = torch.finfo(fp8_dtype).max / t.abs().max()
    return (t * scale).to(fp8_dtype).float() / scale


def test_experts_with_scaled_swiglu_under_delayed_scaling(stand_in):
    """Under te.autocast(recipe=DelayedScaling()) the MXFP8 tutorial's experts run with FP8 GEMMs:
    on operands FP8 represents exactly (as TE's tests make them), the output and the gradient of
    probs are within E4M3's tolerances of the high-precision run's, and the gradient of x within
    E5M2's (DelayedScaling's backward format); the output is FP8's, not the high-precision one."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch import ops

    torch.manual_seed(5)
    seq = _experts(ops, bias=False, activation=ops.ScaledSwiGLU(glu_interleave_size=4))
    with torch.no_grad():
        for p in seq.parameters():
            p.copy_(_on_fp8_grid(torch.randn_like(p) * 0.2))
    x, probs = _on_fp8_grid(torch.randn(17, HIDDEN), SPLITS), torch.rand(17)
    dy = _on_fp8_grid(torch.randn(17, HIDDEN), SPLITS, torch.float8_e5m2)
    splits = torch.tensor(SPLITS, dtype=torch.int32)
    runs = []
    for fp8 in (True, False):
        leaves = x.clone().requires_grad_(), probs.clone().requires_grad_()
        with te.autocast(enabled=fp8, recipe=DelayedScaling()):
            y = seq(leaves[0], splits, leaves[1], splits)
        y.backward(dy)
        runs.append((y, *(t.grad for t in leaves)))
    (y, dx, dprobs), (y_high, dx_high, dprobs_high) = runs
    assert not torch.allclose(y, y_high, **FP32)  # FP8 GEMMs ran
    torch.testing.assert_close(y, y_high, **E4M3)
    torch.testing.assert_close(dprobs, dprobs_high, **E4M3)
    torch.testing.assert_close(dx, dx_high, **E5M2)


def test_scaled_swiglu_bad_inputs_say_what_is_wrong(stand_in):
    from transformer_engine.pytorch import ops

    op, x = ops.ScaledSwiGLU(), torch.randn(17, 40)
    want = r"must hold one value per row of the input: 17 values, shape \(17,\) for an input of shape \(17, 40\)"
    with pytest.raises(ValueError, match=want + r"; got shape \(17, 2\)"):
        op(x, torch.rand(17, 2))
    with pytest.raises(ValueError, match=want + r"; got shape \(16,\)"):
        op(x, torch.rand(16))
    with pytest.raises(ValueError, match=r"shape \(2, 3\) for an input of shape \(2, 3, 40\); got shape \(3, 2, 2\)"):
        op(torch.randn(2, 3, 40), torch.rand(3, 2, 2))
    with pytest.raises(TypeError, match=r"probs \(its extra input\) must be a floating-point tensor.*got a "
                                        r"torch.int64"):
        op(x, torch.ones(17, dtype=torch.int64))
    with pytest.raises(TypeError, match="floating-point tensor.*got list"):
        op(x, [0.5] * 17)
    with pytest.raises(ValueError, match="probs are on meta but the input is on cpu"):
        op(x, torch.rand(17, device="meta"))
    with pytest.raises(TypeError, match=r"ops.ScaledSwiGLU: takes the input and 1 extra input\(s\) \(probs"):
        op(x)
    seq = _experts(ops, bias=False, activation=op)
    splits = torch.tensor(SPLITS)
    with pytest.raises(TypeError, match=r"1 for the ScaledSwiGLU at '1', 1 for the GroupedLinear at '2'\).*got 2"):
        seq(torch.randn(17, HIDDEN), splits, splits)
    with pytest.raises(ValueError, match="ops.ScaledSwiGLU: the input's last dimension must be a positive multiple "
                                         "of 2 \\* glu_interleave_size = 64"):
        ops.ScaledSwiGLU(glu_interleave_size=32)(torch.randn(3, 96), torch.rand(3))
    with pytest.raises(ValueError, match="ops.ScaledSwiGLU: glu_interleave_size must be a positive int or None"):
        ops.ScaledSwiGLU(glu_interleave_size=0)
    with pytest.raises(ValueError, match="activation_recompute_in_mlp=True is not supported"):
        ops.ScaledSwiGLU(activation_recompute_in_mlp=True)
