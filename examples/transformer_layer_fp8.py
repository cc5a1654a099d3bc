"""A te-core TransformerLayer trained for a few steps in FP8 with each recipe, the code a
Transformer Engine user would write (`import te_core as te` instead of
`import transformer_engine.pytorch as te`). Runs on the selected backend (CPU: reference).

    python examples/transformer_layer_fp8.py
"""

import torch

import te_core.modules as te
from te_core import recipe
from te_core.quantization import autocast

RECIPES = {
    "delayed": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16),
    "current": recipe.Float8CurrentScaling(),
    "block": recipe.Float8BlockScaling(),
    "mxfp8": recipe.MXFP8BlockScaling(),
}


def main() -> None:
    seq, batch, hidden = 64, 4, 128  # tokens and features: multiples of 32 for every recipe
    for name, rec in RECIPES.items():
        torch.manual_seed(0)
        layer = te.TransformerLayer(
            hidden,
            4 * hidden,
            num_attention_heads=4,
            normalization="RMSNorm",
            activation="swiglu",
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
        x = torch.randn(seq, batch, hidden, device=layer.layernorm_mlp.fc1_weight.device)
        target = torch.roll(x, 1, dims=0)
        for step in range(5):
            with autocast(enabled=True, recipe=rec):
                # te.checkpoint recomputes the layer in backward with the forward's exact FP8 scales
                out = te.checkpoint(layer, x)
            loss = torch.nn.functional.mse_loss(out.float(), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"{name:>8}: loss after 5 steps {loss.item():.4f}")


if __name__ == "__main__":
    main()
