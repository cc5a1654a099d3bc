"""Extra state written by Transformer Engine's fusible operations (ops.BasicLinear,
ops.GroupedLinear) loads into te-core's: {"forward": {recipe, scale_fwd, amax_history_fwd, ...},
"backward": {recipe, scale_bwd, amax_history_bwd, ...}}, with the operation's own quantizers'
columns (input and weight forward, grad output backward, per group), read through the same
allow-list as a module's."""
from __future__ import annotations

import warnings

import pytest
import torch

import te_core as te
from te_core.modules.fusible_ops import BasicLinear, GroupedLinear
from te_core.recipe import DelayedScaling, Format

from .test_te_checkpoint_formats import _stateless_records
from .test_te_checkpoints import _te_extra_state, te_recipe  # noqa: F401  (fixture)

E4M3 = dict(rtol=0.125, atol=0.0675)
IN, OUT, HISTORY = 16, 24, 4
RECIPE = DelayedScaling(margin=1, fp8_format=Format.E4M3, amax_history_len=HISTORY)


def _op_state(te_recipe, forward: int, backward: int, seed: int = 0, directions=("forward", "backward")) -> dict:
    """What TE's BasicOperation.get_extra_state pickles under DelayedScaling: per direction the
    recipe, the scales and amax histories of `forward` / `backward` quantizers, and its plain
    fp8_meta items (none of its recipe state's or group's)."""
    g = torch.Generator().manual_seed(seed)
    recipe = te_recipe.DelayedScaling(margin=1, fp8_format=te_recipe.Format.E4M3, amax_history_len=HISTORY)
    state = {}
    for direction, suffix, n in (("forward", "fwd", forward), ("backward", "bwd", backward)):
        state[direction] = {"recipe": recipe, f"scale_{suffix}": torch.rand(n, generator=g) + 0.5,
                            f"amax_history_{suffix}": torch.rand(HISTORY, n, generator=g) + 0.1,
                            "extra_fp8_variables": {}}
    return {d: state[d] for d in directions}


def _module_state(te_recipe, op_state: dict, gemms: int) -> dict:
    """The same scales in TE's module form (3 forward, 2 backward columns per GEMM), with other
    values in the output and grad-input columns that modules keep and operations do not."""
    fwd, bwd = op_state["forward"], op_state["backward"]
    scale_fwd, history_fwd = torch.rand(3 * gemms) + 0.5, torch.rand(HISTORY, 3 * gemms)
    scale_bwd, history_bwd = torch.rand(2 * gemms) + 0.5, torch.rand(HISTORY, 2 * gemms)
    for gemm in range(gemms):
        scale_fwd[3 * gemm:3 * gemm + 2] = fwd["scale_fwd"][2 * gemm:2 * gemm + 2]
        history_fwd[:, 3 * gemm:3 * gemm + 2] = fwd["amax_history_fwd"][:, 2 * gemm:2 * gemm + 2]
        scale_bwd[2 * gemm] = bwd["scale_bwd"][gemm]
        history_bwd[:, 2 * gemm] = bwd["amax_history_bwd"][:, gemm]
    return {"recipe": fwd["recipe"], "scale_fwd": scale_fwd, "amax_history_fwd": history_fwd,
            "scale_bwd": scale_bwd, "amax_history_bwd": history_bwd,
            "extra_fp8_variables": {"num_gemms": gemms, "fp8_checkpoint": True}}


def _load(module, state) -> None:
    sd = module.state_dict()
    sd["_extra_state"] = state if isinstance(state, torch.Tensor) else _te_extra_state(state)
    module.load_state_dict(sd)


def _load_silently(module, state) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read, not restarted with a warning
        _load(module, state)


def _assert_slots_are_columns(got: dict, op_state: dict, gemms: int, prefix) -> None:
    """Every slot's scale and history are its column of the operation's state, exactly."""
    for gemm in range(gemms):
        p = prefix(gemm)
        columns = {("forward", f"{p}input"): ("fwd", 2 * gemm), ("forward", f"{p}weight"): ("fwd", 2 * gemm + 1),
                   ("backward", f"{p}grad_output"): ("bwd", gemm)}
        for (direction, slot), (suffix, column) in columns.items():
            if direction not in op_state:
                continue
            saved = op_state[direction]
            assert torch.equal(got[direction][slot]["scale"], saved[f"scale_{suffix}"][column:column + 1]), slot
            assert torch.equal(got[direction][slot]["amax_history"], saved[f"amax_history_{suffix}"][:, column]), slot


def _step(module, x, dy, *splits):
    """One forward and backward under RECIPE: output, input and weight gradients."""
    x = x.clone().requires_grad_()
    with te.autocast(recipe=RECIPE):
        y = module(x, *splits)
    y.backward(dy)
    weights = [p for name, p in module.named_parameters() if name.startswith("weight")]
    return y.detach(), x.grad, [w.grad for w in weights]


def _assert_same_step(got, want) -> None:
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))


def test_basic_linear_restores_te_operation_state(te_recipe):
    """Empty and stateless-recipe operation states restore nothing, silently; a delayed-scaling one
    restores every slot exactly, and the next FP8 step is that of a te.Linear given the same scales
    in TE's module form (and near float64's)."""
    op = BasicLinear(IN, OUT)
    record = _stateless_records(te_recipe)["Float8CurrentScaling"]  # (older TE: the recipe, no scales)
    for stateless in [{}, {"forward": record, "backward": record}]:
        _load_silently(op, stateless)
        assert op.quantization_state() == {"forward": {}, "backward": {}}
    state = _op_state(te_recipe, 2, 1)
    _load_silently(op, state)
    _assert_slots_are_columns(op.quantization_state(), state, 1, lambda gemm: "")

    torch.manual_seed(0)
    linear = te.Linear(IN, OUT, bias=False)
    with torch.no_grad():
        linear.weight.copy_(op.weight)
    _load_silently(linear, _module_state(te_recipe, state, 1))
    x, dy = torch.randn(8, IN), torch.randn(8, OUT)
    got = _step(op, x, dy)
    _assert_same_step(got, _step(linear, x, dy))
    assert torch.equal(op.quantization_state()["forward"]["input"]["scale"],
                       linear.quantization_state()["forward"]["input"]["scale"])
    torch.testing.assert_close(got[0].double(), x.double() @ op.weight.detach().double().T, **E4M3)


@pytest.mark.parametrize("groups", [2, 3])
def test_grouped_linear_restores_te_operation_state(te_recipe, groups):
    """Each group's input, weight and grad-output slots take its columns (TE's get_quantizer:
    forward 2 g and 2 g + 1, backward g), and the next FP8 step is that of a te.GroupedLinear given
    the same scales in TE's module form."""
    state = _op_state(te_recipe, 2 * groups, groups, seed=groups)
    op = GroupedLinear(groups, IN, OUT, bias=False)
    _load_silently(op, state)
    _assert_slots_are_columns(op.quantization_state(), state, groups, lambda gemm: f"gemm{gemm}_")

    module = te.GroupedLinear(groups, IN, OUT, bias=False)
    with torch.no_grad():
        for i in range(groups):
            getattr(module, f"weight{i}").copy_(getattr(op, f"weight{i}"))
    _load_silently(module, _module_state(te_recipe, state, groups))
    splits = [5, 0, 7][:groups]
    x, dy = torch.randn(sum(splits), IN), torch.randn(sum(splits), OUT)
    _assert_same_step(_step(op, x, dy, torch.tensor(splits)), _step(module, x, dy, splits))


@pytest.mark.parametrize("make, columns, counts", [
    (lambda: BasicLinear(IN, OUT), (4, 2), "4 forward and 2 backward tensors, but this BasicLinear has 1 GEMM, so 2 "
                                           "forward and 1 backward"),
    (lambda: BasicLinear(IN, OUT), (3, 2), "3 forward and 2 backward tensors, but this BasicLinear has 1 GEMM, so 2 "
                                           "forward and 1 backward"),
    (lambda: GroupedLinear(3, IN, OUT), (4, 2), "4 forward and 2 backward tensors, but this GroupedLinear has 3 "
                                                "GEMMs, so 6 forward and 3 backward"),
    (lambda: GroupedLinear(2, IN, OUT), (6, None), "6 forward tensors, but this GroupedLinear has 2 GEMMs, so 4 "
                                                   "forward"),
])
def test_operation_state_of_another_column_count_restarts_with_a_warning(te_recipe, make, columns, counts):
    forward, backward = columns
    directions = ("forward",) if backward is None else ("forward", "backward")
    op = make()
    with pytest.warns(UserWarning, match=f"{type(op).__name__}: .*{counts}; it was saved from another operation "
                                         ".*restart.*drop its '_extra_state' entry") as record:
        _load(op, _op_state(te_recipe, forward, backward or 0, directions=directions))
    assert len(record) == 1
    assert op.quantization_state() == {"forward": {}, "backward": {}}


def test_forward_only_operation_state_restores_the_forward_slots(te_recipe):
    """A state with only "forward" restores input and weight; grad_output starts as a new state's
    (scale 1, zero history, not cast yet), and the forward is a te.Linear's given those forward scales."""
    full = _op_state(te_recipe, 2, 1, seed=4)
    op = BasicLinear(IN, OUT)
    _load_silently(op, {"forward": full["forward"]})
    got = op.quantization_state()
    _assert_slots_are_columns(got, {"forward": full["forward"]}, 1, lambda gemm: "")
    assert torch.equal(got["backward"]["grad_output"]["scale"], torch.ones(1))
    assert torch.equal(got["backward"]["grad_output"]["amax_history"], torch.zeros(HISTORY))
    assert op._recipe_state.fresh_slots() == {"forward": {"input": False, "weight": False},
                                              "backward": {"grad_output": True}}
    linear = te.Linear(IN, OUT, bias=False)
    with torch.no_grad():
        linear.weight.copy_(op.weight)
    _load_silently(linear, _module_state(te_recipe, full, 1))
    x = torch.randn(8, IN)
    with torch.no_grad(), te.autocast(recipe=RECIPE):
        assert torch.equal(op(x), linear(x))


def test_forward_only_operation_state_keeps_the_live_backward_state(te_recipe):
    """As TE's set_extra_state skips a direction the checkpoint lacks, an operation that already
    has delayed-scaling state keeps its grad-output scale and history."""
    op = BasicLinear(IN, OUT)
    _step(op, torch.randn(8, IN), torch.randn(8, OUT))
    before = {k: v.clone() for k, v in op.quantization_state()["backward"]["grad_output"].items()}
    assert not torch.equal(before["amax_history"], torch.zeros(HISTORY))
    state = _op_state(te_recipe, 2, 1, seed=5, directions=("forward",))
    _load_silently(op, state)
    got = op.quantization_state()
    _assert_slots_are_columns(got, state, 1, lambda gemm: "")
    assert all(torch.equal(got["backward"]["grad_output"][k], v) for k, v in before.items())


def _chain():
    """RMSNorm, BasicLinear, Bias, SwiGLU, BasicLinear: a Sequential as TE's checkpoints below hold one."""
    from te_core.modules import fusible_ops as ops

    return ops.Sequential(ops.RMSNorm(IN), BasicLinear(IN, 2 * OUT), ops.Bias(2 * OUT), ops.SwiGLU(),
                          BasicLinear(OUT, IN))


def _sequential_with_weights():
    """_chain() with random weights (the norm's around 1)."""
    src = _chain()
    with torch.no_grad():
        for p in src.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
        src[0].weight.add_(1.0)
    return src


def _assert_loads_strictly_and_silently(src, sd) -> None:
    """`sd` (src's weights, TE's extra state) loads into a new _chain() strictly with warnings as
    errors (no norm entry reads as "extra state that is not used"), restores no FP8 state, and
    the loaded chain computes float64's chain on src's weights."""
    dst = _chain()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dst.load_state_dict(sd)  # strict
    assert all(op.quantization_state() == {"forward": {}, "backward": {}} for op in (dst[1], dst[4]))

    x = torch.randn(8, IN)
    w = {k: v.double() for k, v in src.state_dict().items() if not k.endswith("_extra_state")}
    h = x.double()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + dst[0].eps) * w["0.weight"]
    a, b = (h @ w["1.weight"].T + w["2.bias"]).chunk(2, dim=-1)
    want = (a * torch.sigmoid(a) * b) @ w["4.weight"].T
    with torch.no_grad():
        torch.testing.assert_close(dst(x).double(), want, rtol=1.3e-6, atol=1e-5)


def test_te_2_3_to_2_8_sequential_state_loads_silently(te_recipe):
    """TE 2.3-2.8 pickle {} as the extra state of every operation without quantization state (a
    norm, Bias, SwiGLU; later versions write an empty tensor), so each `_extra_state` of their
    Sequential is non-empty: it loads strictly and silently, and the loaded Sequential computes
    float64's chain on the saved weights. Extra state that holds scales is still refused by Bias."""
    from te_core.modules import fusible_ops as ops

    torch.manual_seed(7)
    src = _sequential_with_weights()
    sd = {k: _te_extra_state({}) if k.endswith("_extra_state") else v for k, v in src.state_dict().items()}
    sd["0._extra_state"] = _te_extra_state({})  # (TE's norms are operations and write one)
    _assert_loads_strictly_and_silently(src, sd)

    bias = ops.Bias(4)
    with pytest.raises(ValueError, match="ops.Bias: its _extra_state must be empty"):
        bias.load_state_dict({"bias": torch.zeros(4), "_extra_state": _te_extra_state(_op_state(te_recipe, 2, 1))})


def _te_1_13_op_state(trained: bool, seed: int = 0, history: int = 1024) -> dict:
    """What TE 1.13's BasicOperation.get_extra_state pickled for ops.BasicLinear: one entry per
    quantizer kind with its direction's scale, scale_inv and amax history, and no recipe; untrained,
    the initial values (scale 1, zero history of the default recipe's length) it writes also for an
    operation that never ran FP8."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for mode, suffix in (("input", "fwd"), ("param", "fwd"), ("grad_output", "bwd")):
        scale = torch.rand(1, generator=g) + 0.5 if trained else torch.ones(1)
        amax = torch.rand(history, 1, generator=g) + 0.1 if trained else torch.zeros(history, 1)
        state[mode] = {f"scale_{suffix}": scale, f"scale_inv_{suffix}": 1 / scale, f"amax_history_{suffix}": amax,
                       "extra_fp8_variables": {}}
    return state


def test_trained_te_1_13_operation_state_warns_once_and_restores_nothing():
    """TE 1.13's per-quantizer form records no recipe, so it is not read; holding trained values, it
    warns once that the scales restart, and the next FP8 step is that of an operation never loaded."""
    from te_core.compat.te_checkpoint import holds_fp8_scales

    state = _te_extra_state(_te_1_13_op_state(trained=True, seed=6, history=HISTORY))
    op, fresh = BasicLinear(IN, OUT), BasicLinear(IN, OUT)
    with torch.no_grad():
        fresh.weight.copy_(op.weight)
    with pytest.warns(UserWarning, match="BasicLinear: its extra state is Transformer Engine 1.13's operation state "
                                         ".*not read.*restart.*drop its '_extra_state' entry") as record:
        _load(op, state)
    assert len(record) == 1
    assert op.quantization_state() == {"forward": {}, "backward": {}} and holds_fp8_scales(state)
    x, dy = torch.randn(8, IN), torch.randn(8, OUT)
    got = _step(op, x, dy)
    _assert_same_step(got, _step(fresh, x, dy))
    torch.testing.assert_close(got[0].double(), x.double() @ op.weight.detach().double().T, **E4M3)


def test_untrained_te_1_13_operation_state_loads_silently():
    """TE 1.13's initial values (scale 1, zero histories; None for a quantizer kind an operation
    lacks, as its ops.Quantize's) load silently and restore nothing, and hold no FP8 scales for
    holds_fp8_scales, so a stateless operation (ops.Bias) accepts them too. Any one value off its
    initial one is trained state: the operation warns once, holds_fp8_scales says so, ops.Bias refuses it."""
    from te_core.compat.te_checkpoint import holds_fp8_scales
    from te_core.modules import fusible_ops as ops

    untrained = _te_1_13_op_state(trained=False)
    for state in [untrained, {**untrained, "param": None, "grad_output": None}]:
        op = BasicLinear(IN, OUT)
        _load_silently(op, state)
        assert op.quantization_state() == {"forward": {}, "backward": {}}
        assert not holds_fp8_scales(_te_extra_state(state))
        _load_silently(ops.Bias(4), state)

    for mode, key, index in [("input", "scale_fwd", 0), ("param", "amax_history_fwd", (1023, 0)),
                             ("grad_output", "amax_history_bwd", (0, 0))]:
        state = _te_1_13_op_state(trained=False)
        state[mode][key][index] = torch.rand(()).item() + 0.25  # (never 1 nor 0)
        assert holds_fp8_scales(_te_extra_state(state)), (mode, key)
        op = BasicLinear(IN, OUT)
        with pytest.warns(UserWarning, match="Transformer Engine 1.13's operation state") as record:
            _load(op, state)
        assert len(record) == 1 and op.quantization_state() == {"forward": {}, "backward": {}}
        with pytest.raises(ValueError, match="ops.Bias: its _extra_state must be empty"):
            _load(ops.Bias(4), state)


def _te_1_13_empty() -> torch.Tensor:
    """What TE 1.13's BasicOperation.get_extra_state returns for an operation without FP8 state:
    torch.Tensor(), an empty float32 tensor (later versions: an empty uint8 one)."""
    return torch.Tensor()


@pytest.mark.parametrize("linear_state", ["empty", "initial"])
def test_te_1_13_sequential_state_loads_strictly_and_silently(linear_state):
    """A TE 1.13 Sequential checkpoint: its norm, Bias and SwiGLU write torch.Tensor() (float32,
    empty) as `_extra_state`, its BasicLinears that or their initial per-quantizer state (which
    1.13 writes for an operation that never ran FP8). It loads strictly and silently, and computes
    float64's chain on the saved weights."""
    from te_core.compat.te_checkpoint import holds_fp8_scales

    torch.manual_seed(11)
    src = _sequential_with_weights()
    linear = _te_1_13_empty() if linear_state == "empty" else _te_extra_state(_te_1_13_op_state(trained=False))
    sd = {k: v for k, v in src.state_dict().items() if not k.endswith("_extra_state")}
    for i in range(4):  # (1.13's norms are operations and write one too)
        sd[f"{i}._extra_state"] = _te_1_13_empty()
    for i in (1, 4):
        sd[f"{i}._extra_state"] = linear
    assert not holds_fp8_scales(_te_1_13_empty())
    _assert_loads_strictly_and_silently(src, sd)


def _norm_want(norm, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    h = x.double()
    if isinstance(norm, te.LayerNorm):
        h = h - h.mean(-1, keepdim=True)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps) * weight.double() + bias.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps) * weight.double()


@pytest.mark.parametrize("make", [lambda: te.LayerNorm(IN), lambda: te.RMSNorm(IN), lambda: te.Linear(IN, OUT),
                                  lambda: BasicLinear(IN, OUT)], ids=["LayerNorm", "RMSNorm", "Linear", "BasicLinear"])
def test_modules_take_te_1_13_empty_float32_extra_state(make):
    """te.LayerNorm, te.RMSNorm, te.Linear and ops.BasicLinear load TE 1.13's empty float32
    `_extra_state` strictly and silently, with their saved weights (float64's output); a non-empty
    float32 one is still refused, with the error they give it."""
    torch.manual_seed(12)
    module = make()
    params = {k: torch.randn(v.shape) * 0.5 + (1.0 if k == "weight" and v.dim() == 1 else 0.0)
              for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module.load_state_dict({**params, "_extra_state": _te_1_13_empty()})  # strict
    x = torch.randn(8, IN)
    if isinstance(module, (te.LayerNorm, te.RMSNorm)):
        want = _norm_want(module, x, params["weight"], params.get("bias"))
        refusal = "Unexpected key.*_extra_state"
    else:
        assert module.quantization_state() == {"forward": {}, "backward": {}}
        want = x.double() @ params["weight"].double().T + params.get("bias", torch.zeros(OUT)).double()
        refusal = "unrecognised extra state Tensor"
    with torch.no_grad():
        torch.testing.assert_close(module(x).double(), want, rtol=1.3e-6, atol=1e-5)
    with pytest.raises((RuntimeError, ValueError), match=refusal):
        make().load_state_dict({**params, "_extra_state": torch.randn(5)})


def test_attention_and_stateless_operations_take_te_1_13_empty_float32_extra_state():
    """DotProductAttention and the stateless operations (ops.Bias) take TE 1.13's empty float32
    `_extra_state` as "no state", and still refuse a non-empty float32 one."""
    from te_core.modules import fusible_ops as ops

    torch.manual_seed(13)
    attention = te.DotProductAttention(2, 8, attn_mask_type="no_mask")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention.load_state_dict({"_extra_state": _te_1_13_empty()})
    q, k, v = (torch.randn(6, 3, 2, 8) for _ in range(3))  # sbhd
    d = [t.double().permute(1, 2, 0, 3) for t in (q, k, v)]
    want = torch.softmax(d[0] @ d[1].transpose(-1, -2) / 8 ** 0.5, dim=-1) @ d[2]
    torch.testing.assert_close(attention(q, k, v).double(), want.permute(2, 0, 1, 3).reshape(6, 3, 16),
                               rtol=1.3e-6, atol=1e-5)
    with pytest.raises(ValueError, match="DotProductAttention: unrecognised extra state Tensor"):
        attention.load_state_dict({"_extra_state": torch.randn(5)})

    bias, b = ops.Bias(4), torch.randn(4)
    bias.load_state_dict({"bias": b, "_extra_state": _te_1_13_empty()})
    x = torch.randn(3, 4)
    torch.testing.assert_close(bias(x).double(), x.double() + b.double(), rtol=1.3e-6, atol=1e-5)
    with pytest.raises(ValueError, match="ops.Bias: its _extra_state must be empty"):
        bias.load_state_dict({"bias": b, "_extra_state": torch.randn(5)})
