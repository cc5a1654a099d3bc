"""Public paths called inside a `with torch.device(...)` block, as model-building code often
calls state_dict, load_state_dict and init there: a factory call without device= follows the
block's device, so host-side values (extra state, checkpoint placeholders, lookup tables) would
land on it while the rest stays where it was. Under a meta block such a value is a meta tensor,
which cannot mix with CPU ones, so each case fails here on the CPU as it would on a GPU."""
from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch

import te_core as te
from te_core.modules import fusible_ops as ops
from te_core.optimizers import FusedAdam
from te_core.recipe import DelayedScaling, Format

from .test_te_checkpoints import te_recipe  # noqa: F401  (fixture)
from .test_te_op_checkpoints import IN, OUT, _load, _op_state

FP32 = dict(rtol=1.3e-6, atol=1e-5)
E4M3 = dict(rtol=0.125, atol=0.0675)


def _stateless(kind: str) -> torch.nn.Module:
    """A module that holds no scaling state (never run under a delayed-scaling recipe)."""
    torch.manual_seed(0)
    if kind == "Linear":
        return te.Linear(32, 48)
    if kind == "DotProductAttention":
        return te.DotProductAttention(4, 8)
    return ops.Sequential(ops.RMSNorm(32), ops.BasicLinear(32, 48), ops.Bias(48))


def _inputs(kind: str):
    torch.manual_seed(1)
    if kind == "DotProductAttention":
        return [torch.randn(6, 2, 4, 8) for _ in range(3)]
    return [torch.randn(8, 32)]


def _assert_extra_states_on_cpu(state: dict) -> None:
    extra = {key: value.device for key, value in state.items() if key.endswith("_extra_state")}
    assert extra and all(device.type == "cpu" for device in extra.values()), extra


@pytest.mark.parametrize("kind", ["Linear", "DotProductAttention", "Sequential"])
def test_empty_extra_state_is_a_cpu_tensor(kind):
    """Without scaling state the entry is an empty tensor on the CPU, as the pickled form always
    is (a checkpoint written in a GPU block would otherwise hold device tensors), and loads."""
    source = _stateless(kind)
    with torch.device("meta"):
        state = source.state_dict()
    _assert_extra_states_on_cpu(state)
    target = _stateless(kind)
    for p in target.parameters():
        torch.nn.init.normal_(p)
    target.load_state_dict(state)
    torch.testing.assert_close(target(*_inputs(kind)), source(*_inputs(kind)), **FP32)


def test_transformer_engine_names_state_dict_has_cpu_extra_states():
    from te_core.compat.te_state_dict_names import to_transformer_engine_state_dict

    torch.manual_seed(2)
    kw = dict(num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0)
    source = te.TransformerLayer(32, 64, 4, fuse_qkv_params=False, **kw)
    with torch.device("meta"):
        exported = to_transformer_engine_state_dict(source)
    _assert_extra_states_on_cpu(exported)
    target = te.TransformerLayer(32, 64, 4, fuse_qkv_params=False, **kw)
    target.load_state_dict(exported)
    x = torch.randn(5, 2, 32)
    torch.testing.assert_close(target(x), source(x), **FP32)


def test_te_operation_state_without_backward_direction_loads(te_recipe):  # noqa: F811
    """Transformer Engine's forward-only operation state: the grad-output slot it lacks starts as
    a new state's (scale 1, zero history), made on the CPU like the checkpoint's own entries."""
    state = _op_state(te_recipe, 2, 1, seed=4, directions=("forward",))
    outside, inside = ops.BasicLinear(IN, OUT), ops.BasicLinear(IN, OUT)
    inside.load_state_dict(outside.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _load(outside, state)
        with torch.device("meta"):
            _load(inside, state)
    got, want = inside.quantization_state(), outside.quantization_state()
    for direction in want:
        for slot, entry in want[direction].items():
            for key, value in entry.items():
                assert torch.equal(got[direction][slot][key], value), (direction, slot, key)
    assert torch.equal(got["backward"]["grad_output"]["scale"], torch.ones(1))
    x = torch.randn(8, IN)
    with torch.no_grad(), te.autocast(recipe=DelayedScaling(margin=1, fp8_format=Format.E4M3, amax_history_len=4)):
        assert torch.equal(inside(x), outside(x))


def test_current_scaling_make_empty_on_the_cpu():
    """make_empty(device="cpu") inside a block: the scale-inverse placeholder is made on the
    empty tensor's device, and a cast into it matches a direct cast."""
    quantizer = te.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    with torch.device("meta"):
        empty = quantizer.make_empty((16, 32), dtype=torch.float32, device="cpu")
    assert empty.device.type == "cpu"
    x = torch.randn(16, 32)
    quantizer.update_quantized(x, empty)
    assert torch.equal(empty.dequantize(), quantizer(x).dequantize())
    torch.testing.assert_close(empty.dequantize(), x, **E4M3)


@pytest.mark.parametrize("paged", [False, True], ids=["slots", "paged"])
def test_inference_pre_step_builds_host_tables_on_the_cpu(paged):
    """pre_step's page/slot tables and fixed-shape layout are built on the host and moved once;
    a prefill and a decode step stepped inside a block give the whole sequences' outputs."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(32, 64, 4, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type="causal", layer_number=1, attn_input_format="bshd")
    layer.eval()
    freqs = te.RotaryPositionEmbedding(8)(16)
    pages = dict(is_paged=True, page_size=4, total_num_pages=8) if paged else {}
    params = te.InferenceParams(2, 16, num_heads_kv=2, head_dim_k=8, dtype=torch.float32, qkv_format="bshd",
                                **pages)
    seqs = [torch.randn(6, 32), torch.randn(6, 32)]
    with torch.no_grad():
        want = [layer(s[None], rotary_pos_emb=freqs)[0] for s in seqs]
        done = 0
        for n in (5, 1):
            with torch.device("meta"):
                params.pre_step(OrderedDict(a=n, b=n))
            out = layer(torch.stack([s[done:done + n] for s in seqs]), rotary_pos_emb=freqs, inference_params=params)
            for got, w in zip(out, want):
                torch.testing.assert_close(got, w[done:done + n], **FP32)
            done += n


def test_default_alibi_slopes_inside_a_block():
    """The default ALiBi slopes are computed on the host in float64 and moved to the inputs'
    device; 6 heads take the interleaved slopes past the largest power of two as well."""
    torch.manual_seed(3)
    attention = te.DotProductAttention(6, 8, attn_mask_type="causal")
    q, k, v = (torch.randn(5, 2, 6, 8) for _ in range(3))
    want = attention(q, k, v, core_attention_bias_type="alibi")
    with torch.device("meta"):
        got = attention(q, k, v, core_attention_bias_type="alibi")
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, want, **FP32)


def test_capturable_fused_adam_loads_a_plain_checkpoint_inside_a_block():
    """A checkpoint with the step count and lr as numbers, loaded by a capturable optimizer
    inside a block: they become tensors on the parameters' device and the next step matches."""
    torch.manual_seed(4)
    start = torch.randn(7, 5)
    saver = FusedAdam([torch.nn.Parameter(start.clone())], lr=1e-2)
    for _ in range(3):
        saver.param_groups[0]["params"][0].grad = torch.randn(7, 5)
        saver.step()
    state, weight, grad = saver.state_dict(), saver.param_groups[0]["params"][0].detach(), torch.randn(7, 5)
    resumed = []
    for block in (False, True):
        param = torch.nn.Parameter(weight.clone())
        optimizer = FusedAdam([param], lr=1e-2, capturable=True)
        if block:
            with torch.device("meta"):
                optimizer.load_state_dict(state)
        else:
            optimizer.load_state_dict(state)
        group = optimizer.param_groups[0]
        assert group["step"].device == param.device and group["lr"].device == param.device
        param.grad = grad.clone()
        optimizer.step()
        resumed.append(param.detach())
    assert float(group["step"]) == 4
    torch.testing.assert_close(resumed[1], resumed[0], **FP32)
