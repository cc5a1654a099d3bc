"""PERFORMANCE.md's layer (h4096, ffn 16384, 32 heads, s2048, causal) as one training step,
shared by the layer diagnostics."""
from __future__ import annotations

import torch

import te_core as te
from te_core import recipe

H, FFN, HEADS, SEQ = 4096, 16384, 32, 2048
RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling, "bf16": None}


def inputs(batch: int):
    x = torch.randn(SEQ, batch, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return x, torch.randn(SEQ, batch, H, device="cuda", dtype=torch.bfloat16)


def te_layer():
    return te.TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                               self_attn_mask_type="causal", params_dtype=torch.bfloat16)


def training_step(module, x, dy, recipe_name: str = "delayed", grads: str = "accumulate"):
    """fwd+bwd of `module` under te.autocast with the named recipe (bf16: autocast disabled).
    grads="none" drops .grad first, as after optimizer.zero_grad(): no accumulation."""
    make = RECIPES[recipe_name]
    rcp = None if make is None else make()

    def step():
        if grads == "none":
            x.grad = None
            for p in module.parameters():
                p.grad = None
        with te.autocast(enabled=rcp is not None, recipe=rcp):
            y = module(x)
        y.backward(dy)

    return step
