"""te.convert_model on a Hugging Face Llama built from a config (no weight download):
every nn.Linear and RMSNorm except the LM head becomes a te-core module with the same
weights, then one FP8 training step runs. Needs `transformers`; skipped otherwise.

    python examples/convert_llama.py
"""

import sys

import torch

from te_core import recipe
from te_core.convert import convert_model
from te_core.quantization import autocast


def main() -> int:
    try:
        import transformers
    except ImportError:
        print("transformers is not installed; skipping (pip install transformers)")
        return 0
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    before = model(tokens).logits
    rec = recipe.Float8CurrentScaling()
    convert_model(model, rec, skip=("lm_head",))  # the LM head stays in high precision
    after = model(tokens).logits
    print(f"max |logits difference| after conversion, no FP8: {(after - before).abs().max().item():.2e}")
    with autocast(recipe=rec):
        out = model(tokens, labels=tokens)
    out.loss.backward()
    print(f"FP8 ({type(rec).__name__}) loss {out.loss.item():.4f}; converted modules:")
    print(sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith("te_core")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
