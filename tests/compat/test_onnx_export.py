"""Transformer Engine's ONNX-export switch: te.onnx_export(enabled=False) is a context that does
nothing; enabled=True refuses with what to do instead; is_in_onnx_export_mode() stays False."""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import te_core
from te_core.compat.transformer_engine import uninstall_transformer_engine
from te_core.export import is_in_onnx_export_mode, onnx_export


def test_disabled_is_a_no_op_context_around_a_forward():
    layer, x = te_core.Linear(24, 40), torch.randn(5, 24)
    expected = layer(x)
    with te_core.onnx_export(enabled=False):
        assert not is_in_onnx_export_mode()
        got = layer(x)
    with onnx_export():  # TE's default is enabled=False
        assert torch.equal(layer(x), expected)
    assert torch.equal(got, expected) and not is_in_onnx_export_mode()


def test_disabled_works_as_a_decorator():
    @onnx_export(enabled=False)
    def forward(x):
        return x * 2

    x = torch.randn(3)
    assert torch.equal(forward(x), x * 2)


def test_enabled_refuses_with_what_to_do_instead():
    ran = []
    with pytest.raises(NotImplementedError) as err:
        with te_core.onnx_export(enabled=True):
            ran.append(True)
    message = str(err.value)
    assert not ran and not is_in_onnx_export_mode()
    assert message.startswith("te.onnx_export(enabled=True): te-core does not export ONNX graphs of its FP8 modules")
    assert "torch.onnx.export without this context" in message and "te.autocast(enabled=False)" in message


@pytest.mark.parametrize("value", ["yes", None, 2])
def test_enabled_must_be_a_flag(value):
    with pytest.raises(TypeError, match="onnx_export"):
        with onnx_export(enabled=value):
            pass


def test_te_import_paths_resolve():
    if "transformer_engine" not in sys.modules and importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("a real transformer_engine is installed here")
    uninstall_transformer_engine()
    te_core.install_as_transformer_engine()
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.pytorch.export import is_in_onnx_export_mode as te_mode
        from transformer_engine.pytorch.export import onnx_export as te_export

        assert te.onnx_export is te_export is onnx_export and te_mode is is_in_onnx_export_mode
        with pytest.raises(ImportError, match="te-core does not export ONNX graphs of its FP8 modules"):
            from transformer_engine.pytorch.export import te_translation_table  # noqa: F401
    finally:
        uninstall_transformer_engine()
