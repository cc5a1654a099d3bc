"""API patterns of Transformer Engine's PyTorch documentation notebooks, on te-core's own small
code through the stand-in (reference backend, CPU). The ONNX notebook's export: te-core has no
ONNX form of its FP8 operators (te.onnx_export(enabled=True) refuses and says to export in high
precision with torch.onnx.export), so that export must work: while torch.onnx traces a model, the
contract ops record the reference's standard torch operators instead of te_core custom ops, which
no ONNX translation exists for."""
from __future__ import annotations

import pytest
import torch

FP32 = dict(rtol=1.3e-6, atol=1e-5)
HIDDEN, FFN, HEADS, SEQ, BATCH = 32, 48, 4, 6, 3


def _export_as_torch_onnx_does(model, inputs):
    """torch.export under torch.onnx's exporting flag, as torch.onnx.export(dynamo=True) runs it
    (without needing onnx and onnxscript installed)."""
    flags = pytest.importorskip("torch.onnx._internal.exporter._flags")
    if not hasattr(flags, "set_onnx_exporting_flag"):
        pytest.skip("this torch's ONNX exporter has no exporting flag")
    with torch.no_grad():
        return flags.set_onnx_exporting_flag(torch.export.export)(model, inputs)


def _te_core_targets(program) -> list:
    return [str(node.target) for node in program.graph.nodes if "te_core" in str(node.target)]


def test_onnx_trace_of_a_layernorm_linear_stack_holds_standard_operators(stand_in):
    """LayerNormLinear -> GELU -> Linear exported under torch.onnx's flag: no te_core operator in
    the graph, and the exported program computes float64's result."""
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    model = torch.nn.Sequential(te.LayerNormLinear(HIDDEN, FFN), torch.nn.GELU(approximate="tanh"),
                                te.Linear(FFN, HIDDEN)).eval()
    x = torch.randn(SEQ * BATCH, HIDDEN)
    program = _export_as_torch_onnx_does(model, (x,))
    assert _te_core_targets(program) == []

    ln, fc2 = model[0], model[2]
    h = torch.nn.functional.layer_norm(x.double(), (HIDDEN,), ln.layer_norm_weight.double(),
                                       ln.layer_norm_bias.double(), eps=ln.eps)
    h = torch.nn.functional.gelu(h @ ln.weight.double().T + ln.bias.double(), approximate="tanh")
    expected = h @ fc2.weight.double().T + fc2.bias.double()
    x2 = torch.randn(SEQ * BATCH, HIDDEN)  # the exported program on fresh inputs too
    h2 = torch.nn.functional.layer_norm(x2.double(), (HIDDEN,), ln.layer_norm_weight.double(),
                                        ln.layer_norm_bias.double(), eps=ln.eps)
    h2 = torch.nn.functional.gelu(h2 @ ln.weight.double().T + ln.bias.double(), approximate="tanh")
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x).double(), expected, **FP32)
        torch.testing.assert_close(program.module()(x2).double(), h2 @ fc2.weight.double().T + fc2.bias.double(),
                                   **FP32)


def test_onnx_trace_of_a_transformer_layer_matches_eager(stand_in):
    """The notebook's model, small: TransformerLayer exported under torch.onnx's flag holds no
    te_core operator and computes what the eager layer does."""
    import transformer_engine.pytorch as te

    torch.manual_seed(1)
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0).eval()
    x = torch.randn(SEQ, BATCH, HIDDEN)
    program = _export_as_torch_onnx_does(layer, (x,))
    assert _te_core_targets(program) == []
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), layer(x), **FP32)


def test_torch_onnx_export_of_a_transformer_layer(stand_in, tmp_path):
    """torch.onnx.export(dynamo=True), as the notebook calls it but without te.onnx_export and FP8
    (te-core's advice): the file loads in onnxruntime and computes the eager layer's output."""
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    import transformer_engine.pytorch as te

    torch.manual_seed(2)
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0).eval()
    x = torch.randn(SEQ, BATCH, HIDDEN)
    path = str(tmp_path / "layer.onnx")
    with torch.no_grad():
        torch.onnx.export(layer, (x,), path, output_names=["output"], dynamo=True)
        expected = layer(x)
    session = ort.InferenceSession(path)
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), expected, **FP32)
