"""The benchmark layer (te.TransformerLayer h4096, ffn 16384, 32 heads, s2048, causal, bf16
parameters, as bench_modules.py builds it) as one training step, shared by the layer
diagnostics. Import it after putting benchmarks/ on sys.path."""
from __future__ import annotations

import torch
from bench_modules import TorchLayer
from bench_modules import te_layer as _te_layer

import te_core as te
from te_core import recipe

H, FFN, HEADS, SEQ = 4096, 16384, 32, 2048
RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
           "block": recipe.Float8BlockScaling, "bf16": None}


def inputs(batch: int, hidden: int = H):
    x = torch.randn(SEQ, batch, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return x, torch.randn(SEQ, batch, hidden, device="cuda", dtype=torch.bfloat16)


def te_layer(hidden: int = H):
    """The layer; another hidden size keeps the sweep's proportions (ffn 4x hidden, 128 per head)."""
    return _te_layer(hidden, FFN * hidden // H, HEADS * hidden // H)


def torch_layer():
    """The plain-PyTorch bf16 layer of the same size."""
    return TorchLayer(H, FFN, HEADS).to("cuda", torch.bfloat16)


def training_step(module, x, dy, recipe_name: str = "delayed", grads: str = "accumulate", compiled: bool = False):
    """fwd+bwd of `module` under te.autocast with the named recipe (bf16: autocast disabled).
    grads="none" drops .grad first, as after optimizer.zero_grad(): no accumulation. compiled:
    the forward, te.autocast included, under torch.compile (inductor's default mode), as the
    sweep's compiled cells run it."""
    make = RECIPES[recipe_name]
    rcp = None if make is None else make()

    def forward(inp):
        with te.autocast(enabled=rcp is not None, recipe=rcp):
            return module(inp)

    forward = torch.compile(forward) if compiled else forward

    def step():
        if grads == "none":
            x.grad = None
            for p in module.parameters():
                p.grad = None
        forward(x).backward(dy)

    return step
