"""fuse_wgrad_accumulation on LayerNormLinear, LayerNormMLP and GroupedLinear: the weight
gradients of every micro-batch are added into the user's float32 `weight.main_grad`, weight.grad
stays None, and every other gradient is unchanged (compared with the same module unfused)."""
import copy

import pytest
import torch

import te_core.modules as tm

from ._compare import randomize_

FP32 = dict(rtol=1.3e-6, atol=1e-5)
BUILD = {
    "LayerNormLinear": (lambda **kw: tm.LayerNormLinear(24, 40, **kw), ("weight",), lambda m, x: m(x)),
    "LayerNormMLP": (lambda **kw: tm.LayerNormMLP(24, 40, activation="swiglu", **kw), ("fc1_weight", "fc2_weight"),
                     lambda m, x: m(x)),
    # the second expert gets no tokens: nothing is added into its main_grad
    "GroupedLinear": (lambda **kw: tm.GroupedLinear(3, 24, 40, **kw), ("weight0", "weight1", "weight2"),
                      lambda m, x: m(x, [5, 0, 7])),
}


def _plain_and_fused(build):
    """The module without and with fuse_wgrad_accumulation, same (randomized) parameters."""
    torch.manual_seed(0)
    plain = build()
    randomize_(plain, seed=3, std=0.2)
    fused = build(fuse_wgrad_accumulation=True)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


@pytest.mark.parametrize("name", list(BUILD))
def test_weight_gradients_accumulate_into_main_grad(name):
    build, weights, run = BUILD[name]
    plain, fused = _plain_and_fused(build)
    params = dict(fused.named_parameters())
    start = {w: torch.randn(params[w].shape) for w in weights}
    for w in weights:
        params[w].main_grad = start[w].clone()
    for step in range(2):  # two micro-batches: both land in main_grad
        x = torch.randn(12, 24)
        y_plain, y_fused = run(plain, x), run(fused, x)
        dy = torch.randn(y_plain.shape)
        y_plain.backward(dy)
        y_fused.backward(dy)
    for pname, p_plain in plain.named_parameters():
        p = params[pname]
        if pname in weights:
            assert p.grad is None
            torch.testing.assert_close(p.main_grad - start[pname], p_plain.grad, **FP32)
        else:
            torch.testing.assert_close(p.grad, p_plain.grad, **FP32)
    assert (params[weights[-1]].main_grad != start[weights[-1]]).any()


@pytest.mark.parametrize("name", list(BUILD))
def test_missing_main_grad_is_an_error(name):
    build, weights, run = BUILD[name]
    mod = build(fuse_wgrad_accumulation=True)
    y = run(mod, torch.randn(12, 24))
    with pytest.raises(RuntimeError, match=rf"{name}\(fuse_wgrad_accumulation=True\): weight.main_grad is not set"):
        y.backward(torch.randn(y.shape))


def test_main_grad_of_the_wrong_shape_is_an_error():
    mod = tm.LayerNormLinear(24, 40, fuse_wgrad_accumulation=True)
    mod.weight.main_grad = torch.zeros(24, 40)
    y = mod(torch.randn(12, 24))
    with pytest.raises(RuntimeError, match=r"main_grad has shape \(24, 40\).*must match the weight \(\(40, 24\)"):
        y.backward(torch.randn(12, 40))


def test_bf16_weights_accumulate_in_float32():
    """The point of main_grad: bf16 weights, float32 accumulation matching a float64 computation."""
    torch.manual_seed(0)
    mod = tm.LayerNormLinear(32, 16, normalization="RMSNorm", bias=False, params_dtype=torch.bfloat16,
                             fuse_wgrad_accumulation=True)
    mod.weight.main_grad = torch.zeros(16, 32)
    ref = copy.deepcopy(mod)
    total = torch.zeros(16, 32, dtype=torch.float64)
    for _ in range(3):
        x, dy = torch.randn(8, 32, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
        mod(x).backward(dy)
        ln = torch.nn.functional.rms_norm(x.float(), (32,), ref.layer_norm_weight.float(), 1e-5).bfloat16()
        total += dy.double().T @ ln.double()
    torch.testing.assert_close(mod.weight.main_grad.double(), total, rtol=1.6e-2, atol=1e-5)


@pytest.mark.parametrize("build", [
    lambda **kw: tm.MultiheadAttention(16, 2, attention_dropout=0.0, input_layernorm=True, **kw),
    lambda **kw: tm.TransformerLayer(16, 32, 2, hidden_dropout=0.0, attention_dropout=0.0, **kw),
], ids=["MultiheadAttention", "TransformerLayer"])
def test_blocks_pass_fuse_wgrad_accumulation_to_every_weight(build):
    torch.manual_seed(0)
    plain = build()
    fused = build(fuse_wgrad_accumulation=True)
    fused.load_state_dict(plain.state_dict())
    params = dict(fused.named_parameters())
    weights = [n for n, p in params.items() if p.dim() == 2]
    assert len(weights) >= 2
    for n in weights:
        params[n].main_grad = torch.zeros(params[n].shape)
    x = torch.randn(5, 2, 16)
    dy = torch.randn(5, 2, 16)
    plain(x).backward(dy)
    fused(x).backward(dy)
    for n, p_plain in plain.named_parameters():
        if n in weights:
            assert params[n].grad is None
            torch.testing.assert_close(params[n].main_grad, p_plain.grad, **FP32)
        else:
            torch.testing.assert_close(params[n].grad, p_plain.grad, **FP32)


BUILD_WITH_LINEAR = {**BUILD, "Linear": (lambda **kw: tm.Linear(24, 40, **kw), ("weight",), lambda m, x: m(x))}


def _megatron_style(module, weights, zero_out=False):
    """What Megatron-LM's data-parallel wrapper does to each weight: main_grad, the
    grad_added_to_main_grad flag (False each step), and a hook after the gradient's accumulation
    that adds .grad into main_grad unless the flag says it is there already, then drops .grad."""
    fired = []
    params = dict(module.named_parameters())
    for name in weights:
        p = params[name]
        p.main_grad = torch.zeros(p.shape)
        p.grad_added_to_main_grad = False
        if zero_out:
            p.zero_out_wgrad = True

        def hook(param, name=name):
            fired.append(name)
            assert param.grad is not None and param.grad.shape == param.shape
            if not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False):
                param.main_grad.add_(param.grad)
            param.grad = None

        p.register_post_accumulate_grad_hook(hook)
    return params, fired


@pytest.mark.parametrize("zero_out", [False, True])
@pytest.mark.parametrize("name", list(BUILD_WITH_LINEAR))
def test_megatron_grad_added_to_main_grad_protocol(name, zero_out):
    """A weight carrying grad_added_to_main_grad gets the flag set and a placeholder gradient, as
    Transformer Engine hands it: the wrapper's hook runs once per weight and step (an expert
    without tokens included) and main_grad holds exactly the weight gradients."""
    build, weights, run = BUILD_WITH_LINEAR[name]
    plain, fused = _plain_and_fused(build)
    params, fired = _megatron_style(fused, weights, zero_out)
    want = {w: torch.zeros(params[w].shape) for w in weights}
    plain_params = dict(plain.named_parameters())
    for step in range(2):
        for w in weights:
            params[w].grad_added_to_main_grad = False  # reset each step by the wrapper
        x = torch.randn(12, 24)
        y_plain, y_fused = run(plain, x), run(fused, x)
        dy = torch.randn(y_plain.shape)
        y_plain.backward(dy)
        y_fused.backward(dy)
        for w in weights:
            want[w] += plain_params[w].grad
            plain_params[w].grad = None
            assert params[w].grad_added_to_main_grad and params[w].grad is None
        assert sorted(fired) == sorted(list(weights) * (step + 1))
    for w in weights:
        torch.testing.assert_close(params[w].main_grad, want[w], **FP32)


def test_megatron_protocol_under_torch_compile():
    """Compiled, the flag cannot be set at run time: the placeholder is zeros, which the hook
    adds harmlessly."""
    torch.manual_seed(1)
    plain, fused = tm.Linear(24, 40), tm.Linear(24, 40, fuse_wgrad_accumulation=True)
    fused.load_state_dict(plain.state_dict())
    params, fired = _megatron_style(fused, ("weight",))
    compiled = torch.compile(lambda x: fused(x), fullgraph=True)
    want = torch.zeros(40, 24)
    for _ in range(2):
        params["weight"].grad_added_to_main_grad = False
        x, dy = torch.randn(12, 24), torch.randn(12, 40)
        plain(x).backward(dy)
        compiled(x).backward(dy)
        want += plain.weight.grad
        plain.weight.grad = None
    assert fired == ["weight", "weight"]
    torch.testing.assert_close(params["weight"].main_grad, want, **FP32)


@pytest.mark.parametrize("name", ["Linear", *BUILD])
def test_a_first_micro_batch_writes_main_grad(name):
    """is_first_microbatch=True: the wgrad GEMM writes main_grad, dropping what it held (as
    Transformer Engine's does: its GEMM does not accumulate then); the later micro-batches
    (False) and steps without the flag (None) add into it. An expert without tokens gets zeros
    on a first micro-batch."""
    build, weights, run = BUILD_WITH_LINEAR[name]
    plain, fused = _plain_and_fused(build)
    params = dict(fused.named_parameters())
    for w in weights:
        params[w].main_grad = torch.full(params[w].shape, 100.0)  # the previous step's, never zeroed
    sums = {}
    for flag in (True, False, None):
        x = torch.randn(12, 24)
        kw = {"is_first_microbatch": flag}
        y_plain = plain(x, [5, 0, 7], **kw) if name == "GroupedLinear" else plain(x, **kw)
        y_fused = fused(x, [5, 0, 7], **kw) if name == "GroupedLinear" else fused(x, **kw)
        dy = torch.randn(y_plain.shape)
        y_plain.backward(dy)
        y_fused.backward(dy)
        for pname in weights:
            grad = dict(plain.named_parameters())[pname].grad
            sums[pname] = grad.clone() if flag else sums[pname] + grad
            torch.testing.assert_close(params[pname].main_grad, sums[pname], **FP32, msg=f"{pname} after {flag}")
        plain.zero_grad(set_to_none=True)


@pytest.mark.parametrize("delay", [False, True], ids=["now", "delay_wgrad_compute"])
def test_overwrite_main_grad_writes_main_grad_of_grouped_linear(delay):
    """weight.overwrite_main_grad=True (Megatron-FSDP sets it): every micro-batch's wgrad GEMM
    writes main_grad instead of adding into it, as Transformer Engine's GroupedLinear does (it
    reads weight0's flag for every GEMM); an expert without tokens gets zeros. Compared with
    dy_i^T x_i in float64."""
    torch.manual_seed(0)
    mod = tm.GroupedLinear(3, 24, 40, bias=False, fuse_wgrad_accumulation=True, delay_wgrad_compute=delay)
    randomize_(mod, seed=3, std=0.2)
    weights = mod._params("weight")
    for w in weights:
        w.main_grad = torch.full(w.shape, 100.0)  # what a plain accumulation would keep adding to
    mod.weight0.overwrite_main_grad = True
    splits = [5, 0, 7]
    for _ in range(2):  # the second micro-batch overwrites the first's too
        x, dy = torch.randn(12, 24), torch.randn(12, 40)
        mod(x, splits).backward(dy)
        if delay:
            mod.backward_dw()
        for w, x_i, dy_i in zip(weights, x.split(splits), dy.split(splits)):
            assert w.grad is None
            torch.testing.assert_close(w.main_grad.double(), dy_i.double().T @ x_i.double(), **FP32)


def test_overwrite_main_grad_writes_main_grad_of_each_flagged_weight():
    """Linear, LayerNormLinear and LayerNormMLP read each weight's overwrite_main_grad, as
    Transformer Engine's modules do (LayerNormMLP fc1's and fc2's apart): a flagged weight's
    main_grad takes the micro-batch's wgrad, an unflagged one adds it. Compared with the wgrads
    of a copy of the module without fusion (the modules take no float64)."""
    torch.manual_seed(1)
    x, dy = torch.randn(12, 24), torch.randn(12, 24)
    for module, flagged in ((tm.Linear(24, 24, bias=False, fuse_wgrad_accumulation=True), {"weight"}),
                            (tm.LayerNormLinear(24, 24, bias=False, fuse_wgrad_accumulation=True), {"weight"}),
                            (tm.LayerNormMLP(24, 40, bias=False, fuse_wgrad_accumulation=True), {"fc2_weight"})):
        randomize_(module, seed=4, std=0.2)
        twin = copy.deepcopy(module)
        twin.fuse_wgrad_accumulation = False
        twin(x).backward(dy)
        weights = {n: p for n, p in module.named_parameters() if p.dim() == 2}
        for name, w in weights.items():
            w.main_grad = torch.full(w.shape, 100.0)
            w.overwrite_main_grad = name in flagged
        module(x).backward(dy)
        expected = dict(twin.named_parameters())
        for name, w in weights.items():
            base = 0.0 if name in flagged else 100.0
            torch.testing.assert_close(w.main_grad, expected[name].grad + base, **FP32, msg=name)
