"""Transformer Engine's tensor-parallel attributes on the GEMM modules' parameters, which
Megatron-LM reads (tensor_model_parallel, partition_dim, partition_stride; sequence_parallel on
parameters each rank holds whole): set as TE sets them, with and without tensor parallelism."""
import pytest

import te_core as te


def _attrs(module):
    return {name: (getattr(p, "tensor_model_parallel", None), getattr(p, "partition_dim", None),
                   getattr(p, "partition_stride", None)) for name, p in module.named_parameters()}


SPLIT_ROWS, SPLIT_COLUMNS, NONE = (True, 0, 1), (True, 1, 1), (None, None, None)


@pytest.mark.parametrize("mode, tp", [(None, 1), ("column", 1), ("row", 1), ("column", 2), ("row", 2)])
def test_linear(mode, tp):
    layer = te.Linear(64, 32, parallel_mode=mode, tp_size=tp)
    want_weight = SPLIT_COLUMNS if mode == "row" else SPLIT_ROWS
    assert _attrs(layer) == {"weight": want_weight, "bias": SPLIT_ROWS if mode == "column" else NONE}
    if mode == "row":
        assert layer.bias.sequence_parallel is False  # (True only under sequence parallelism)


def test_layernorm_linear_and_mlp():
    ln_linear = te.LayerNormLinear(64, 32, parallel_mode="column", tp_size=2)
    assert _attrs(ln_linear) == {"layer_norm_weight": NONE, "layer_norm_bias": NONE, "weight": SPLIT_ROWS,
                                 "bias": SPLIT_ROWS}
    mlp = te.LayerNormMLP(64, 128, tp_size=2, set_parallel_mode=True, sequence_parallel=True)
    assert _attrs(mlp) == {"layer_norm_weight": NONE, "layer_norm_bias": NONE, "fc1_weight": SPLIT_ROWS,
                           "fc1_bias": SPLIT_ROWS, "fc2_weight": SPLIT_COLUMNS, "fc2_bias": NONE}
    assert mlp.layer_norm_weight.sequence_parallel and mlp.fc2_bias.sequence_parallel


def test_grouped_linear_and_parameters_split():
    grouped = te.GroupedLinear(2, 64, 32)
    assert _attrs(grouped) == {"weight0": SPLIT_ROWS, "bias0": NONE, "weight1": SPLIT_ROWS, "bias1": NONE}
    split = te.Linear(64, 96, parameters_split=("query_", "key_", "value_"))
    assert all(_attrs(split)[f"{part}_weight"] == SPLIT_ROWS for part in ("query", "key", "value"))


def test_transformer_layer_projections():
    layer = te.TransformerLayer(64, 128, 4, tp_size=2, set_parallel_mode=True)
    attrs = _attrs(layer)
    assert attrs["self_attention.layernorm_qkv.weight"] == SPLIT_ROWS  # column-parallel QKV
    assert attrs["self_attention.proj.weight"] == SPLIT_COLUMNS  # row-parallel output projection
    assert attrs["layernorm_mlp.fc2_weight"] == SPLIT_COLUMNS
