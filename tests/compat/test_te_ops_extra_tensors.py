"""Transformer Engine's extra tensors between fusible operations (transformer_engine.pytorch.ops):
named channels (set_extra_output_channel / set_extra_input_channel), which pass an extra output to
later operations inside a Sequential, public or hidden from the caller; and BasicOperation
subclasses written for TE with extra inputs or outputs (fuser_forward / fuser_backward). Forward and
every gradient against float64 on random inputs; the binding rules and their errors as TE's
(transformer_engine/pytorch/ops/op.py and fuser.py)."""
from __future__ import annotations

import pytest
import torch

from te_core.modules import fusible_ops as ops

FP32 = dict(rtol=1.3e-6, atol=1e-5)
TOLS = {torch.float32: FP32}  # (routing is dtype-blind: float32 shows it with TE's tightest tolerances)
H = 24


def _leaves(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def _check(got, want, tols, what):
    torch.testing.assert_close(got.double(), want.double(), **tols, msg=lambda m: f"{what}: {m}")


def _residual_block(dtype, to_caller):
    """Sequential(MakeExtraOutput -> "residual", Bias, AddExtraInput <- "residual"): x + b + x."""
    residual, body, add = ops.MakeExtraOutput(), ops.Bias(H, dtype=dtype), ops.AddExtraInput()
    with torch.no_grad():
        body.bias.normal_()
    residual.set_extra_output_channel(0, "residual", output_to_caller=to_caller)
    add.set_extra_input_channel(0, "residual")
    return ops.Sequential(residual, body, add), body


@pytest.mark.parametrize("to_caller", [True, False], ids=["public", "hidden"])
def test_residual_channel_matches_float64(to_caller, dtype=torch.float32):
    """The residual goes through the channel, not the caller: seq(x) takes no extra input and returns
    (y, residual), or y alone where the channel is hidden; x's gradient sums both paths."""
    torch.manual_seed(3)
    seq, body = _residual_block(dtype, to_caller)
    x = torch.randn(4, 5, H, dtype=dtype, requires_grad=True)
    dy, dres = torch.randn(4, 5, H, dtype=dtype), torch.randn(4, 5, H, dtype=dtype)
    out = seq(x)
    x64, b64 = _leaves(x, body.bias)
    want = x64 + b64 + x64
    if to_caller:
        y, res = out
        torch.autograd.backward((y, res), (dy, dres))
        _check(res, x64, TOLS[dtype], "residual")
        torch.autograd.backward((want, x64 * 1), (dy.double(), dres.double()))
    else:
        assert isinstance(out, torch.Tensor)
        y = out
        y.backward(dy)
        want.backward(dy.double())
    _check(y, want, TOLS[dtype], "y")
    _check(x.grad, x64.grad, TOLS[dtype], "dx")
    _check(body.bias.grad, b64.grad, TOLS[dtype], "dbias")


def test_channel_fans_out_and_leaves_unbound_slots_to_the_caller():
    """One producer feeds two consumers; a third AddExtraInput, unbound, still takes the caller's
    extra input, and only its gradient goes back to the caller's tensor."""
    torch.manual_seed(4)
    producer, first, second, external = ops.MakeExtraOutput(), ops.AddExtraInput(), ops.AddExtraInput(), \
        ops.AddExtraInput()
    producer.set_extra_output_channel(0, "route")
    first.set_extra_input_channel(0, "route")
    second.set_extra_input_channel(0, "route")
    seq = ops.Sequential(producer, ops.ConstantScale(0.75), first, second, external)
    x, extra = torch.randn(6, H, requires_grad=True), torch.randn(6, H, requires_grad=True)
    dy, droute = torch.randn(6, H), torch.randn(6, H)
    y, route = seq(x, extra)
    torch.autograd.backward((y, route), (dy, droute))
    x64, e64 = _leaves(x, extra)
    want = 0.75 * x64 + x64 + x64 + e64
    torch.autograd.backward((want, x64 * 1), (dy.double(), droute.double()))
    _check(y, want, FP32, "y")
    _check(route, x64, FP32, "route")
    _check(x.grad, x64.grad, FP32, "dx")
    _check(extra.grad, e64.grad, FP32, "dextra")
    with pytest.raises(TypeError, match=r"takes the input and 1 extra input\(s\) \(1 for the AddExtraInput at '4'\)"):
        seq(x, extra, extra)


class _TwoScaledOutputs(ops.BasicOperation):
    """Written for TE: the input on, and (s0 * input, s1 * input) as extra outputs."""

    num_extra_outputs = 2

    def __init__(self, scales):
        super().__init__()
        self.scales = scales

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, **unused):
        s0, s1 = self.scales
        return input_, [(s0 * input_, s1 * input_)]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        (g0, g1), (s0, s1) = basic_op_grad_extra_outputs[0], self.scales
        return grad_output + s0 * g0 + s1 * g1, [()], [()]


class _MeanSquare(ops.BasicOperation):
    """Written for TE: the input on, and its rows' mean square as a fresh extra output."""

    num_extra_outputs = 1

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, **unused):
        basic_op_ctxs[0].save_for_backward(input_)
        return input_, [(input_.square().mean(-1),)]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        (x,) = basic_op_ctxs[0].saved_tensors
        (g,) = basic_op_grad_extra_outputs[0]
        return grad_output + g.unsqueeze(-1) * 2 * x / x.size(-1), [()], [()]


class _ScaleRowsByExtra(ops.BasicOperation):
    """Written for TE: input * (the extra input, one scale per row) times a learnable gain."""

    num_extra_inputs = 1

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.randn(H))

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, **unused):
        (scale,) = basic_op_extra_inputs[0]
        ctx = basic_op_ctxs[0]
        ctx.scale_requires_grad = scale.requires_grad
        ctx.save_for_backward(input_, scale)
        return input_ * scale.unsqueeze(-1) * self.gain, [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        x, scale = ctx.saved_tensors
        dgain = (grad_output * x * scale.unsqueeze(-1)).reshape(-1, H).sum(0)
        dscale = (grad_output * x * self.gain).sum(-1) if ctx.scale_requires_grad else None
        return grad_output * scale.unsqueeze(-1) * self.gain, [(dgain,)], [(dscale,)]


def test_te_style_operations_with_extra_outputs_and_hidden_channels():
    """TE's fuser_forward / fuser_backward operations, one output hidden in a channel and one public:
    y = x + 3x (the hidden 2x-channel is unused, the public 3x is added), with the caller's gradient
    of the public output reaching x."""
    torch.manual_seed(5)
    producer, add = _TwoScaledOutputs((2.0, 3.0)), ops.AddExtraInput()
    producer.set_extra_output_channel(0, "internal", output_to_caller=False)
    producer.set_extra_output_channel(1, "public")
    add.set_extra_input_channel(0, "public")
    x = torch.randn(5, H, requires_grad=True)
    dy, dpub = torch.randn(5, H), torch.randn(5, H)
    y, public = ops.Sequential(producer, add)(x)
    torch.autograd.backward((y, public), (dy, dpub))
    (x64,) = _leaves(x)
    want = x64 + 3 * x64
    torch.autograd.backward((want, 3 * x64), (dy.double(), dpub.double()))
    _check(y, want, FP32, "y")
    _check(public, 3 * x64, FP32, "public")
    _check(x.grad, x64.grad, FP32, "dx")


def test_fresh_channel_tensor_gets_its_consumers_gradient(dtype=torch.float32):
    """A hidden channel tensor made inside the producer (the rows' mean square) feeds a consumer
    with a parameter: the consumer sees it requires grad and the gradients reach x and the gain."""
    torch.manual_seed(6)
    producer, consumer = _MeanSquare(), _ScaleRowsByExtra().to(dtype)
    producer.set_extra_output_channel(0, "scale", output_to_caller=False)
    consumer.set_extra_input_channel(0, "scale")
    x = torch.randn(3, 4, H, dtype=dtype, requires_grad=True)
    dy = torch.randn(3, 4, H, dtype=dtype)
    y = ops.Sequential(producer, consumer)(x)
    y.backward(dy)
    x64, g64 = _leaves(x, consumer.gain)
    want = x64 * x64.square().mean(-1, keepdim=True) * g64
    want.backward(dy.double())
    _check(y, want, TOLS[dtype], "y")
    _check(x.grad, x64.grad, TOLS[dtype], "dx")
    _check(consumer.gain.grad, g64.grad, TOLS[dtype], "dgain")


def test_te_style_operation_alone_takes_and_returns_its_extra_tensors():
    """Called directly, a fuser_forward operation with an extra input takes it and returns its
    gradient; op_forward with extra slots is refused with what to define instead."""
    torch.manual_seed(7)
    op = _ScaleRowsByExtra()
    x, scale = torch.randn(6, H, requires_grad=True), torch.rand(6, requires_grad=True)
    dy = torch.randn(6, H)
    op(x, scale).backward(dy)
    x64, s64, g64 = _leaves(x, scale, op.gain)
    (x64 * s64.unsqueeze(-1) * g64).backward(dy.double())
    for got, want, what in ((x.grad, x64.grad, "dx"), (scale.grad, s64.grad, "dscale"), (op.gain.grad, g64.grad,
                                                                                         "dgain")):
        _check(got, want, FP32, what)
    with pytest.raises(TypeError, match=r"takes the input and 1 extra input\(s\).*got 0"):
        op(x)

    class OpForwardWithExtraInput(ops.BasicOperation):
        num_extra_inputs = 1

        def op_forward(self, ctx, input_, **unused):
            return input_

    with pytest.raises(NotImplementedError, match="define fuser_forward"):
        OpForwardWithExtraInput()(x, scale)


def test_binding_errors_are_te_s():
    producer, consumer = ops.MakeExtraOutput(), ops.AddExtraInput()
    for bind, index in ((producer.set_extra_output_channel, -1), (producer.set_extra_output_channel, 1),
                        (consumer.set_extra_input_channel, -1), (consumer.set_extra_input_channel, 1)):
        with pytest.raises(IndexError, match="out of range"):
            bind(index, "route")
    for bind in (producer.set_extra_output_channel, consumer.set_extra_input_channel):
        for bad in ("", 123):
            with pytest.raises(ValueError, match="non-empty string"):
                bind(0, bad)
    with pytest.raises(TypeError, match="output_to_caller must be a bool"):
        producer.set_extra_output_channel(0, "route", output_to_caller=1)
    with pytest.raises(TypeError, match="bind the channel on the basic operation"):
        ops.FusedOperation([ops.AddExtraInput()]).set_extra_input_channel(0, "route")


def test_routing_errors_are_te_s():
    """No producer (also where a plain module ends the run), none earlier, two producers."""
    x = torch.randn(2, H)

    def pair(channel_out="route", channel_in="route"):
        producer, consumer = ops.MakeExtraOutput(), ops.AddExtraInput()
        producer.set_extra_output_channel(0, channel_out)
        consumer.set_extra_input_channel(0, channel_in)
        return producer, consumer

    producer, consumer = pair(channel_in="missing")
    with pytest.raises(ValueError, match="'missing' consumed by the AddExtraInput at '1' has no producer"):
        ops.Sequential(producer, consumer)(x)
    producer, consumer = pair()
    with pytest.raises(ValueError, match="has no producer among the fusible operations"):
        ops.Sequential(producer, torch.nn.Identity(), consumer)(x)
    producer, consumer = pair()
    with pytest.raises(ValueError, match="has no earlier producer"):
        ops.Sequential(consumer, producer)(x)
    producer, consumer = pair()
    other = ops.MakeExtraOutput().set_extra_output_channel(0, "route")
    with pytest.raises(ValueError, match="'route' has multiple producers"):
        ops.Sequential(producer, other, consumer)(x)
    two = _TwoScaledOutputs((1.0, 1.0))
    two.set_extra_output_channel(0, "route")
    two.set_extra_output_channel(1, "route")
    with pytest.raises(ValueError, match="multiple producers"):
        ops.Sequential(two, ops.AddExtraInput().set_extra_input_channel(0, "route"))(x)


def test_rebinding_picks_one_source_and_bindings_freeze_at_the_first_run():
    """The last binding of an input wins (the other output stays public); after a run, rebinding
    raises, as TE's fuser does once it has captured the routing."""
    torch.manual_seed(8)
    producer_a, scale, producer_b, add = ops.MakeExtraOutput(), ops.ConstantScale(2.0), ops.MakeExtraOutput(), \
        ops.AddExtraInput()
    producer_a.set_extra_output_channel(0, "a")
    producer_b.set_extra_output_channel(0, "b")
    add.set_extra_input_channel(0, "a")
    add.set_extra_input_channel(0, "b")
    assert not add._extra_tensor_channels_locked
    x = torch.randn(3, H)
    y, out_a, out_b = ops.Sequential(producer_a, scale, producer_b, add)(x)
    _check(y, 4 * x.double(), FP32, "y")
    _check(out_a, x, FP32, "a")
    _check(out_b, 2 * x.double(), FP32, "b")
    assert add._extra_tensor_channels_locked
    with pytest.raises(RuntimeError, match="already captured its channel routing"):
        add.set_extra_input_channel(0, None)
    with pytest.raises(RuntimeError, match="already captured its channel routing"):
        producer_a.set_extra_output_channel(0, "a", output_to_caller=False)


def test_channels_inside_a_fused_operation_of_a_sequential_are_refused():
    producer, consumer = ops.MakeExtraOutput(), ops.AddExtraInput()
    producer.set_extra_output_channel(0, "route")
    consumer.set_extra_input_channel(0, "route")
    with pytest.raises(ValueError, match="put those basic operations in the Sequential themselves"):
        ops.Sequential(ops.FusedOperation([producer, consumer]))(torch.randn(2, H))
