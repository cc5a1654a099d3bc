"""Transformer Engine's ONNX-export switch (`onnx_export`, `is_in_onnx_export_mode`), for code
ported from TE that wraps its export or its forward in it.

te-core does not write ONNX graphs of its FP8 operators (TE's own ONNX ops and translation
table have no te-core counterpart), so only the disabled switch runs; asking for export
mode is an error that says what to do instead, never a graph exported without FP8.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ._flags import flag

__all__ = ["onnx_export", "is_in_onnx_export_mode"]

_NO_ONNX = (
    "te.onnx_export(enabled=True): te-core does not export ONNX graphs of its FP8 modules (Transformer "
    "Engine's FP8 ONNX operators and te_translation_table have no te-core counterpart). To export the "
    "model, run it without FP8 (outside te.autocast, or te.autocast(enabled=False)) and call "
    "torch.onnx.export without this context, so the graph holds the modules' high-precision "
    "operations; for FP8 inference, run te-core under te.autocast instead of exporting"
)


@contextmanager
def onnx_export(enabled: bool = False) -> Iterator[None]:
    """Transformer Engine's context for ONNX export. enabled=False (TE's default) does nothing;
    enabled=True raises NotImplementedError on entry (see the module docstring)."""
    if flag(enabled, "enabled", "onnx_export"):
        raise NotImplementedError(_NO_ONNX)
    yield


def is_in_onnx_export_mode() -> bool:
    """Always False: te-core never enters ONNX export mode (onnx_export(enabled=True) raises)."""
    return False
