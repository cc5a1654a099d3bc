"""Transformer Engine's files of its fusible operations, for the stand-in: code imports an operation
from the file that defines it (`from transformer_engine.pytorch.ops.basic.l2normalization import
L2Normalization`, as TE's own tests do) as well as from `transformer_engine.pytorch.ops`.

Each entry is a file of TE's `ops/` or `ops/basic/` and the classes TE defines there that te-core
provides (te_core.modules.fusible_ops, whose own files are laid out differently). TE's `ops/fused/`
files and its fuser are absent: te-core fuses nothing, so it has none of their classes.
"""
from __future__ import annotations

# transformer_engine/pytorch/ops/<file>.py
OPS_FILES = {
    "linear": ("Linear",),
    "op": ("FusibleOperation", "BasicOperation", "FusedOperation"),
    "sequential": ("Sequential",),
}

# transformer_engine/pytorch/ops/basic/<file>.py
OPS_BASIC_FILES = {
    "activation": ("GELU", "GEGLU", "GLU", "QGELU", "QGEGLU", "ReLU", "ReGLU", "SReLU", "ScaledSReLU", "SReGLU",
                   "SiLU"),
    "add_extra_input": ("AddExtraInput",),
    "all_gather": ("AllGather",),
    "all_reduce": ("AllReduce",),
    "basic_linear": ("BasicLinear",),
    "bias": ("Bias",),
    "constant_scale": ("ConstantScale",),
    "dropout": ("Dropout",),
    "grouped_linear": ("GroupedLinear",),
    "identity": ("Identity",),
    "l2normalization": ("L2Normalization",),
    "layer_norm": ("LayerNorm",),
    "make_extra_output": ("MakeExtraOutput",),
    "quantize": ("Quantize",),
    "reduce_scatter": ("ReduceScatter",),
    "reshape": ("Reshape",),
    "rmsnorm": ("RMSNorm",),
    "swiglu": ("SwiGLU", "SiTUGLU", "ClampedSwiGLU", "ScaledSwiGLU", "ScaledSiTUGLU", "ScaledClampedQGeGLU"),
}
