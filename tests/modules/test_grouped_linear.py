"""te.GroupedLinear's Transformer Engine compatibility at its edges: checkpoints in TE's
single-grouped-parameter format (`weight` [num_gemms, out, in], `bias` [num_gemms, out]) and
m_splits given as a floating-point tensor, each checked against a float64 computation of the
grouped GEMM on fresh random inputs."""
import pytest
import torch

import te_core as te

N, IN, OUT = 3, 16, 8


def _reference(x, splits, weights, biases):
    """x's row groups through their weights, in float64."""
    return torch.cat([x_i.double() @ w.double().T + b.double()
                      for x_i, w, b in zip(x.split(splits), weights, biases)])


def _grouped_checkpoint(bias_shape=(N, OUT)):
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(N, OUT, IN, generator=g, device="cpu").to(torch.get_default_device())
    bias = torch.randn(*bias_shape, generator=g, device="cpu").to(torch.get_default_device())
    return weight, bias


@pytest.mark.parametrize("bias_shape", [(N, OUT), (N, 1, OUT)], ids=["bias", "bias_with_middle_dim"])
def test_te_single_grouped_weight_checkpoint_loads_per_gemm(bias_shape):
    """TE's per-GEMM module loads a checkpoint written with single_grouped_weight /
    single_grouped_bias: the stacked tensors split into weight{i} / bias{i}, also under a prefix."""
    weight, bias = _grouped_checkpoint(bias_shape)
    model = torch.nn.Sequential(te.GroupedLinear(N, IN, OUT))
    model.load_state_dict({"0.weight": weight, "0.bias": bias, "0._extra_state": torch.empty(0, dtype=torch.uint8)})
    mod = model[0]
    x, splits = torch.randn(12, IN), [5, 0, 7]
    want = _reference(x, splits, weight.unbind(0), bias.reshape(N, OUT).unbind(0))
    torch.testing.assert_close(mod(x, splits).double(), want, rtol=1.3e-6, atol=1e-5)


def test_a_redundant_grouped_key_next_to_per_gemm_keys_is_dropped():
    """As in TE: the per-GEMM tensors load, the grouped copy beside them is ignored."""
    weight, bias = _grouped_checkpoint()
    mod = te.GroupedLinear(N, IN, OUT)
    state = {**{f"weight{i}": weight[i] for i in range(N)}, **{f"bias{i}": bias[i] for i in range(N)},
             "weight": torch.randn(N, OUT, IN), "bias": torch.randn(N, OUT),
             "_extra_state": torch.empty(0, dtype=torch.uint8)}
    mod.load_state_dict(state)
    for i in range(N):
        assert torch.equal(getattr(mod, f"weight{i}"), weight[i]) and torch.equal(getattr(mod, f"bias{i}"), bias[i])


def test_a_grouped_weight_of_the_wrong_shape_names_the_expected_one():
    weight, bias = _grouped_checkpoint()
    mod = te.GroupedLinear(N, IN, OUT)
    with pytest.raises(RuntimeError, match=r"weight: Transformer Engine's grouped weight must be \(3, 8, 16\) .*"
                                           r"got shape \(3, 16, 8\)"):
        mod.load_state_dict({"weight": weight.transpose(1, 2), "bias": bias})
    with pytest.raises(RuntimeError, match=r"bias: Transformer Engine's grouped bias must be \(3, 8\) or "
                                           r"\(3, 1, 8\) .*got shape \(2, 8\)"):
        mod.load_state_dict({"weight": weight, "bias": bias[:2]})


def test_a_float_tensor_m_splits_of_whole_counts_is_taken():
    """TE casts a tensor m_splits of any dtype to int64."""
    mod = te.GroupedLinear(N, IN, OUT)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_()
    x, splits = torch.randn(10, IN), [3, 0, 7]
    want = _reference(x, splits, mod._params("weight"), mod._params("bias"))
    got = mod(x, torch.tensor(splits, dtype=torch.float32))
    torch.testing.assert_close(got.double(), want, rtol=1.3e-6, atol=1e-5)
    with pytest.raises(ValueError, match=r"m_splits must hold whole row counts, got 3.5 in \[3.0, 3.5, 3.5\]"):
        mod(x, torch.tensor([3.0, 3.5, 3.5]))


def test_te_grouped_layout_flags_fall_back_as_te_does(monkeypatch):
    """TE's experimental single_grouped_weight / single_grouped_bias without
    NVTE_GROUPED_LINEAR_SINGLE_PARAM: a warning and per-expert parameters (TE's fallback), which
    compute the same as a module built without them; with the variable set, te-core refuses.
    use_grouped_tensor (TE's fused grouped GEMM) takes a bool or None and changes no value."""
    monkeypatch.delenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", raising=False)
    torch.manual_seed(0)
    plain = te.GroupedLinear(2, 16, 8)
    with pytest.warns(UserWarning, match="NVTE_GROUPED_LINEAR_SINGLE_PARAM is not set: per-expert parameters"):
        flagged = te.GroupedLinear(2, 16, 8, single_grouped_weight=True, single_grouped_bias=True,
                                   use_grouped_tensor=True)
    assert [n for n, _ in flagged.named_parameters()] == ["weight0", "bias0", "weight1", "bias1"]
    assert not flagged.single_grouped_weight and not flagged.single_grouped_bias and flagged.use_grouped_tensor
    flagged.load_state_dict(plain.state_dict())
    x = torch.randn(6, 16)
    assert torch.equal(flagged(x, [2, 4]), plain(x, [2, 4]))
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")
    with pytest.raises(NotImplementedError, match="single_grouped_weight / single_grouped_bias with"):
        te.GroupedLinear(2, 16, 8, single_grouped_bias=True)
    with pytest.raises(TypeError, match="use_grouped_tensor must be a bool or None"):
        te.GroupedLinear(2, 16, 8, use_grouped_tensor="yes")


def test_forward_takes_te_positional_arguments_and_float_split_lists():
    """TE's forward(inp, m_splits, is_first_microbatch, out, dgrad_out) positionally, and
    m_splits as a list of whole floats, which TE turns into an int64 tensor: the same result as
    ints; a fraction is an error."""
    torch.manual_seed(0)
    layer, x = te.GroupedLinear(2, 16, 8), torch.randn(6, 16)
    assert torch.equal(layer(x, [2.0, 4.0]), layer(x, [2, 4]))
    assert torch.equal(layer(x, [2, 4], None, None, None), layer(x, [2, 4]))
    assert torch.equal(layer(x, [2, 4], None, torch.empty(6, 8)), layer(x, [2, 4]))
    with pytest.raises(ValueError, match=r"GroupedLinear.forward: out= must be a \(6, 8\)"):
        layer(x, [2, 4], None, torch.empty(7, 8))
    with pytest.raises(ValueError, match="dgrad_out= must not require grad"):
        layer(x, [2, 4], None, None, torch.empty(6, 16, requires_grad=True))
    with pytest.raises(ValueError, match="m_splits must hold whole row counts, got 2.5"):
        layer(x, [2.5, 3.5])
