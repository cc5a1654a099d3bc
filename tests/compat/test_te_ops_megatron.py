"""The part of Transformer Engine's fusible-operation API that Megatron-LM's
`--use-transformer-engine-op-fuser` MLP builds from (transformer_engine.pytorch.ops: RMSNorm,
LayerNorm, BasicLinear, Bias, the activations, FusibleOperation), through the stand-in: operations
built on the meta device and then given a model's existing Parameters, as Megatron-LM's adapters
do; forward and every gradient against a float64 computation, landing on the original Parameters;
under te.autocast BasicLinear against te-core's Linear; main_grad; its fused residual RMSNorm
(MakeExtraOutput: Sequential's extra outputs); the errors of bad inputs. The collectives
(AllReduce, ReduceScatter) are tested on ranks: tests/distributed/test_te_ops_tp.py."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import te_core
from te_core.recipe import DelayedScaling

FP32 = dict(rtol=1.3e-6, atol=1e-5)
E4M3 = dict(rtol=0.125, atol=0.0675)
HIDDEN, FFN = 32, 48


def _fused_mlp(ops, fc1, fc2, activation):
    """Megatron-LM's TEFusedMLP._make_fused_impl without tensor parallelism: a norm, linear and
    bias operation per module, each built on meta and given that module's parameters."""
    norm_type = ops.LayerNorm if fc1.normalization == "LayerNorm" else ops.RMSNorm
    norm = norm_type(fc1.weight.size(1), eps=fc1.eps, device="meta", dtype=fc1.layer_norm_weight.dtype,
                     zero_centered_gamma=fc1.zero_centered_gamma)
    norm.weight = fc1.layer_norm_weight
    if fc1.normalization == "LayerNorm":
        norm.bias = fc1.layer_norm_bias
    seq = ops.Sequential()
    seq.append(norm)
    for module, after in ((fc1, activation), (fc2, None)):
        linear = ops.BasicLinear(module.weight.size(1), module.weight.size(0), device="meta",
                                 dtype=module.weight.dtype, tensor_parallel_mode=None, tensor_parallel_group=None,
                                 sequence_parallel=False, rng_state_tracker_function=None,
                                 accumulate_into_main_grad=module.fuse_wgrad_accumulation, userbuffers_options=None)
        linear.weight = module.weight
        bias = ops.Bias(module.bias.numel(), device="meta", dtype=module.bias.dtype)
        bias.bias = module.bias
        seq.append(linear)
        seq.append(bias)
        if after is not None:
            seq.append(after)
    return seq


def _modules(normalization: str, gated: bool, zero_centered_gamma: bool):
    """Megatron-LM's fc1 (a LayerNormLinear) and fc2 (a Linear), every parameter random."""
    fc1 = te_core.LayerNormLinear(HIDDEN, 2 * FFN if gated else FFN, normalization=normalization,
                                  zero_centered_gamma=zero_centered_gamma)
    fc2 = te_core.Linear(FFN, HIDDEN)
    with torch.no_grad():
        for p in (*fc1.parameters(), *fc2.parameters()):
            p.normal_(std=0.3)
    return fc1, fc2


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _float64_mlp(x, fc1, fc2, activation: str):
    """(y, [x, then fc1's and fc2's parameters]) in float64 autograd."""
    names = ["layer_norm_weight", "weight", "bias"] + (["layer_norm_bias"] if fc1.normalization == "LayerNorm" else [])
    originals = [getattr(fc1, n) for n in names] + [fc2.weight, fc2.bias]
    leaves = [t.detach().double().requires_grad_() for t in [x, *originals]]
    x64, g, w1, b1, *rest = leaves
    beta, (w2, b2) = (rest[0], rest[1:]) if fc1.normalization == "LayerNorm" else (None, rest)
    gamma = g + 1 if fc1.zero_centered_gamma else g
    if beta is None:
        h = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + fc1.eps) * gamma
    else:
        centered = x64 - x64.mean(-1, keepdim=True)
        h = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + fc1.eps) * gamma + beta
    h = h @ w1.T + b1
    if activation == "swiglu":
        a, b = h.chunk(2, dim=-1)  # gate first
        h = a * torch.sigmoid(a) * b
    else:
        h = _gelu_tanh(h)
    return h @ w2.T + b2, leaves, [x, *originals]


@pytest.mark.parametrize("shape", [(11, HIDDEN), (3, 5, HIDDEN)], ids=["2d", "3d"])
@pytest.mark.parametrize("config", [("RMSNorm", "SwiGLU", False), ("LayerNorm", "GELU", True)],
                         ids=["rmsnorm-swiglu", "layernorm-gelu-zero_centered_gamma"])
def test_fused_mlp_trains_the_models_parameters(stand_in, config, shape):
    """Sequential(norm, BasicLinear, Bias, activation, BasicLinear, Bias) on a model's parameters:
    the output and the gradients of x and of every one of the model's own Parameters (the
    operations hold them, no copies) equal float64's."""
    from transformer_engine.pytorch import ops

    normalization, activation, zero_centered_gamma = config
    torch.manual_seed(0)
    fc1, fc2 = _modules(normalization, activation == "SwiGLU", zero_centered_gamma)
    seq = _fused_mlp(ops, fc1, fc2, getattr(ops, activation)())
    model_params = {id(p) for p in (*fc1.parameters(), *fc2.parameters())}
    assert {id(p) for p in seq.parameters()} == model_params
    x = torch.randn(shape, requires_grad=True)
    y = seq(x)
    want, leaves, originals = _float64_mlp(x, fc1, fc2, activation.lower())
    torch.testing.assert_close(y.double(), want, **FP32)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy.double())
    for tensor, leaf in zip(originals, leaves, strict=True):
        torch.testing.assert_close(tensor.grad.double(), leaf.grad, **FP32)


@pytest.mark.parametrize("name", ["GELU", "ReLU", "SiLU", "GEGLU", "ReGLU"])
def test_activations_match_float64(stand_in, name):
    """Each activation on an odd shape, forward and gradient; the gated ones apply the activation
    to the first half of the input's last dimension (TE's order, not torch's GLU)."""
    from transformer_engine.pytorch import ops

    act = {"GELU": _gelu_tanh, "ReLU": torch.relu, "SiLU": lambda t: t * torch.sigmoid(t)}
    act.update(GEGLU=act["GELU"], ReGLU=act["ReLU"])
    torch.manual_seed(1)
    x = torch.randn(3, 5, 2 * 7, requires_grad=True)
    y = getattr(ops, name)(cache_quantized_input=False)(x)
    x64 = x.detach().double().requires_grad_()
    if name.endswith("GLU"):
        a, b = x64.chunk(2, dim=-1)
        want = act[name](a) * b
    else:
        want = act[name](x64)
    torch.testing.assert_close(y.double(), want, **FP32)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, **FP32)


def test_basic_linear_under_delayed_scaling_is_te_linear(stand_in):
    """Under te.autocast(recipe=DelayedScaling()) BasicLinear's GEMMs are te-core's Linear's: on the
    first step its output is bitwise a Linear(bias=False)'s with the same weight, and FP8's, not the
    high-precision one; the input and weight gradients are the Linear's too."""
    from transformer_engine.pytorch import ops

    torch.manual_seed(2)
    linear = te_core.Linear(HIDDEN, FFN, bias=False)
    op = ops.BasicLinear(HIDDEN, FFN, device="meta")
    op.weight = torch.nn.Parameter(torch.randn(FFN, HIDDEN) * 0.2)
    with torch.no_grad():
        linear.weight.copy_(op.weight)
    x = torch.randn(2, 8, HIDDEN)
    x_op, x_own = x.clone().requires_grad_(), x.clone().requires_grad_()
    with te_core.autocast(recipe=DelayedScaling()):
        y, want = op(x_op), linear(x_own)
    assert torch.equal(y, want)
    with torch.no_grad():
        assert not torch.allclose(y, op(x), **FP32)  # FP8 GEMMs ran
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(x_op.grad, x_own.grad, **E4M3)
    torch.testing.assert_close(op.weight.grad, linear.weight.grad, **E4M3)


def test_accumulate_into_main_grad(stand_in):
    """accumulate_into_main_grad=True: the weight gradient (float64's) is added into the assigned
    weight's main_grad; autograd gets Megatron-LM's placeholder, grad_added_to_main_grad is set."""
    from transformer_engine.pytorch.ops import BasicLinear

    torch.manual_seed(3)
    op = BasicLinear(HIDDEN, FFN, device="meta", accumulate_into_main_grad=True)
    weight = torch.nn.Parameter(torch.randn(FFN, HIDDEN))
    start = torch.randn(FFN, HIDDEN)
    weight.main_grad, weight.grad_added_to_main_grad = start.clone(), False
    op.weight = weight
    x, dy = torch.randn(2, 7, HIDDEN, requires_grad=True), torch.randn(2, 7, FFN)
    op(x).backward(dy)
    want = dy.reshape(-1, FFN).double().T @ x.detach().reshape(-1, HIDDEN).double()
    torch.testing.assert_close((weight.main_grad - start).double(), want, **FP32)
    assert weight.grad_added_to_main_grad
    torch.testing.assert_close(x.grad.double(), dy.double() @ weight.detach().double(), **FP32)


def test_operations_left_on_meta_initialize_at_first_forward(stand_in):
    """As in Transformer Engine: an operation built on meta and given no parameter initializes its
    own at its first forward (weight as torch.nn.Linear's, bias zeros, norm weight ones)."""
    from transformer_engine.pytorch import ops

    torch.manual_seed(4)
    seq = ops.Sequential(ops.RMSNorm(HIDDEN, device="meta"), ops.BasicLinear(HIDDEN, FFN, device="meta"),
                         ops.Bias(FFN, device="meta"))
    x = torch.randn(5, HIDDEN)
    y = seq(x)
    assert not any(p.is_meta for p in seq.parameters())
    norm, linear, bias = seq
    assert torch.equal(norm.weight, torch.ones(HIDDEN)) and torch.equal(bias.bias, torch.zeros(FFN))
    bound = HIDDEN ** -0.5  # kaiming_uniform(a=sqrt(5)): uniform within 1/sqrt(in_features), std bound/sqrt(3)
    assert linear.weight.abs().max() <= bound and linear.weight.std() > 0.5 * bound / 3 ** 0.5
    x64 = x.double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) @ linear.weight.double().T
    torch.testing.assert_close(y.double(), want, **FP32)


def _fused_residual_rmsnorm(ops, norm):
    """Megatron-LM's TEFusedResidualRMSNorm._make_fused_impl: MakeExtraOutput, then an RMSNorm
    operation built on meta and given the te.RMSNorm module's weight."""
    kwargs = dict(eps=norm.eps, device="meta", dtype=norm.weight.dtype, zero_centered_gamma=norm.zero_centered_gamma)
    if hasattr(norm, "_sm_margins"):
        kwargs["sm_margin"] = norm._sm_margins
    op = ops.RMSNorm(norm.weight.shape, **kwargs)
    op.weight = norm.weight
    seq = ops.Sequential()
    seq.append(ops.MakeExtraOutput())
    seq.append(op)
    return seq


@pytest.mark.parametrize("use_residual", [True, False], ids=["residual-used", "residual-unused"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zero_centered_gamma"])
def test_fused_residual_rmsnorm_returns_normalized_and_residual(stand_in, zero_centered_gamma, use_residual):
    """Sequential(MakeExtraOutput(), RMSNorm) returns (normalized, residual): float64's RMSNorm and
    the input itself; the gradients of both outputs sum into the input's (the norm's alone where the
    residual is not used), and the module's weight gets float64's gradient."""
    from transformer_engine.pytorch import ops

    torch.manual_seed(5)
    norm = te_core.RMSNorm(HIDDEN, eps=1e-6, zero_centered_gamma=zero_centered_gamma)
    with torch.no_grad():
        norm.weight.normal_(std=0.3)
    seq = _fused_residual_rmsnorm(ops, norm)
    x = torch.randn(3, 7, HIDDEN, requires_grad=True)
    out = seq(x)
    assert isinstance(out, tuple) and len(out) == 2
    y, residual = out
    assert torch.equal(residual, x) and residual.requires_grad
    x64, g64 = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    gamma = g64 + 1 if zero_centered_gamma else g64
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma
    torch.testing.assert_close(y.double(), want, **FP32)
    dy, dres = torch.randn_like(y), torch.randn_like(x)
    if use_residual:
        torch.autograd.backward([y, residual], [dy, dres])
        torch.autograd.backward([want, x64], [dy.double(), dres.double()])
    else:
        y.backward(dy)
        want.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, **FP32)
    torch.testing.assert_close(norm.weight.grad.double(), g64.grad, **FP32)


def test_sequential_returns_extra_outputs_in_order(stand_in):
    """Sequential returns its output alone without extra-output operations, else (output, extra
    outputs in the order of the operations), across plain modules too; MakeExtraOutput alone
    returns (input, input); every extra output's gradient reaches the input (float64's)."""
    from transformer_engine.pytorch import ops

    torch.manual_seed(6)
    plain = ops.Sequential(ops.RMSNorm(HIDDEN), ops.BasicLinear(HIDDEN, FFN))
    x = torch.randn(5, HIDDEN, requires_grad=True)
    assert isinstance(plain(x), torch.Tensor)
    linear = ops.BasicLinear(HIDDEN, FFN)
    seq = ops.Sequential(ops.MakeExtraOutput(), linear, torch.nn.Tanh(), ops.MakeExtraOutput(in_place=True),
                         ops.GELU())
    y, first, second = seq(x)
    x64, w64 = x.detach().double().requires_grad_(), linear.weight.detach().double().requires_grad_()
    h64 = torch.tanh(x64 @ w64.T)
    torch.testing.assert_close(first, x, rtol=0, atol=0)
    torch.testing.assert_close(second.double(), h64, **FP32)
    torch.testing.assert_close(y.double(), _gelu_tanh(h64), **FP32)
    grads = [torch.randn_like(t) for t in (y, first, second)]
    torch.autograd.backward([y, first, second], grads)
    torch.autograd.backward([_gelu_tanh(h64), x64, h64], [g.double() for g in grads])
    torch.testing.assert_close(x.grad.double(), x64.grad, **FP32)
    torch.testing.assert_close(linear.weight.grad.double(), w64.grad, **FP32)
    alone = ops.MakeExtraOutput()(x)
    assert isinstance(alone, tuple) and len(alone) == 2 and all(torch.equal(t, x) for t in alone)


def test_names_imports_and_state_dict(stand_in):
    """TE's parameter names, isinstance(op, ops.FusibleOperation) for every operation, an
    _extra_state entry for the linear, bias and activation operations; the rest of TE's
    fusible-operation API keeps explaining itself."""
    from transformer_engine.pytorch import ops

    seq = ops.Sequential(ops.LayerNorm(8), ops.BasicLinear(8, 16), ops.Bias(16), ops.GEGLU(), ops.RMSNorm(8))
    assert all(isinstance(op, ops.FusibleOperation) for op in seq)
    assert [n for n, _ in seq.named_parameters()] == ["0.weight", "0.bias", "1.weight", "2.bias", "4.weight"]
    assert list(seq.state_dict()) == ["0.weight", "0.bias", "1.weight", "1._extra_state", "2.bias", "2._extra_state",
                                      "3._extra_state", "4.weight"]
    assert seq[1].weight.shape == (16, 8) and (seq[1].local_in_features, seq[1].local_out_features) == (8, 16)
    copy = ops.Sequential(ops.LayerNorm(8), ops.BasicLinear(8, 16), ops.Bias(16), ops.GEGLU(), ops.RMSNorm(8))
    with torch.no_grad():
        for p in seq.parameters():
            p.normal_()
    copy.load_state_dict(seq.state_dict())
    x = torch.randn(3, 8)
    assert torch.equal(copy(x), seq(x))
    with pytest.raises(ImportError, match="not its fused operations nor its fuser"):
        from transformer_engine.pytorch.ops import is_op_fuser_grouped_tensor_path_supported  # noqa: F401


def test_bad_inputs_say_what_is_wrong(stand_in):
    from transformer_engine.pytorch import ops

    op = ops.BasicLinear(HIDDEN, FFN)
    with pytest.raises(ValueError, match=r"ops.BasicLinear: input has shape \(4, 16\); its last dimension must be "
                                         r"in_features=32"):
        op(torch.randn(4, 16))
    with pytest.raises(NotImplementedError, match=r"userbuffers_options=\{'comm_name': 'fc1'\}.*not supported"):
        ops.BasicLinear(HIDDEN, FFN, userbuffers_options={"comm_name": "fc1"})
    with pytest.raises(ValueError, match="tensor_parallel_mode must be None, 'column' or 'row', got 'diagonal'"):
        ops.BasicLinear(HIDDEN, FFN, tensor_parallel_mode="diagonal")
    with pytest.raises(RuntimeError, match="ops.BasicLinear: tensor parallelism .* torch.distributed is not "
                                           "initialized"):
        ops.BasicLinear(HIDDEN, FFN, tensor_parallel_mode="column")
    with pytest.raises(TypeError, match="ops.BasicLinear: dtype must be"):
        ops.BasicLinear(HIDDEN, FFN, dtype=torch.int8)
    op = ops.BasicLinear(HIDDEN, FFN, device="meta")
    op.weight = torch.nn.Parameter(torch.randn(HIDDEN, FFN))
    with pytest.raises(ValueError, match=r"its weight has shape \(32, 48\) but the operation was built for "
                                         r"\(out_features, in_features\) = \(48, 32\)"):
        op(torch.randn(4, HIDDEN))
    with pytest.raises(TypeError, match=r"ops.BasicLinear: takes the input and 0 extra input"):
        op(torch.randn(4, HIDDEN), torch.tensor([4]))
    bias = ops.Bias(FFN)
    with pytest.raises(ValueError, match=r"ops.Bias: input has shape \(4, 32\); its last dimension must be the "
                                         r"bias's size=48"):
        bias(torch.randn(4, HIDDEN))
    bias.bias = torch.nn.Parameter(torch.randn(HIDDEN))
    with pytest.raises(ValueError, match=r"ops.Bias: its bias has shape \(32,\) but the operation was built for 48"):
        bias(torch.randn(4, FFN))
    norm = ops.RMSNorm(HIDDEN, device="meta")
    norm.weight = torch.nn.Parameter(torch.randn(FFN))
    with pytest.raises(ValueError, match=r"ops.RMSNorm: its weight has shape \(48,\) but the operation was built for "
                                         r"normalized_shape=\(32,\)"):
        norm(torch.randn(4, HIDDEN))
    with pytest.raises(TypeError, match="ops.GELU.*cache_quantized_input"):
        ops.GELU(cache_quantized_input="yes")
    with pytest.raises(ValueError, match=r"ops.ReGLU: the input's last dimension must be a positive multiple of 2"):
        ops.ReGLU()(torch.randn(3, 5))
    with pytest.raises(TypeError, match="ops.ReLU: input must be a float32, bfloat16 or float16 tensor, got "
                                        "torch.int64"):
        ops.ReLU()(torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="ops.MakeExtraOutput: in_place must be"):
        ops.MakeExtraOutput(in_place="yes")

    class OneExtraOutput(ops.FusibleOperation, torch.nn.Module):
        num_extra_outputs = 1

        def forward(self, x):
            return x

    with pytest.raises(TypeError, match=r"ops.Sequential: the OneExtraOutput at '1' declares num_extra_outputs=1, so "
                                        r"it must return a tuple \(output, \*1 extra output\(s\)\); it returned "
                                        r"Tensor"):
        ops.Sequential(ops.MakeExtraOutput(), OneExtraOutput())(torch.randn(2, 3))
