"""A small GPT built from te-core modules: byte embedding, TransformerLayers with rotary
positions, a final norm and an LM head (kept in high precision, as is usual for FP8 training).

With `tensor_parallel` (te_core.demo.parallel builds it) the layers split their heads and FFN
features over the ranks of a group; under sequence parallelism each rank gets its block of every
sequence, and the layers run in the (seq, batch, hidden) layout whose first dimension they split."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from .. import ops
from ..modules import Linear, RMSNorm, RotaryPositionEmbedding, TransformerLayer
from .data import VOCAB_SIZE


@dataclass(frozen=True)
class GPTConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    seq_len: int
    batch_size: int
    vocab_size: int = VOCAB_SIZE

    @property
    def ffn_hidden_size(self) -> int:
        return 4 * self.hidden_size

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def as_dict(self) -> dict:
        return dict(asdict(self), ffn_hidden_size=self.ffn_hidden_size)


# Sizes: hidden, head, ffn sizes and tokens per step are multiples of 32, so every recipe
# (MXFP8's 32-element blocks included) can quantize every GEMM operand.
SIZES = {
    "tiny": GPTConfig(hidden_size=64, num_layers=1, num_heads=2, seq_len=64, batch_size=4),
    "small": GPTConfig(hidden_size=128, num_layers=2, num_heads=4, seq_len=128, batch_size=8),
    "medium": GPTConfig(hidden_size=256, num_layers=4, num_heads=8, seq_len=256, batch_size=16),
    "large": GPTConfig(hidden_size=512, num_layers=6, num_heads=8, seq_len=256, batch_size=32),
    # the accelerator default: GEMMs large enough (16k tokens x 2048 x 8192) for FP8 to pay
    "xl": GPTConfig(hidden_size=2048, num_layers=4, num_heads=16, seq_len=1024, batch_size=16),
}
CPU_DEFAULT, ACCELERATOR_DEFAULT = "small", "xl"


def fp8_context(fp8_recipe):
    """te.autocast(recipe) for an FP8 run; nothing for a BF16 run. Scales are reduced over the
    default group (every rank) when torch.distributed is initialized, so all ranks keep one scale."""
    if fp8_recipe is None:
        return contextlib.nullcontext()
    from ..quantization import autocast

    return autocast(enabled=True, recipe=fp8_recipe)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, device: torch.device, tensor_parallel: Optional[dict] = None):
        """`tensor_parallel`: TransformerLayer's tp_group, tp_size and sequence_parallel (None: one process)."""
        super().__init__()
        self.config = config
        tp = dict(tensor_parallel or {})
        self.sequence_shards = tp["tp_size"] if tp.get("sequence_parallel") else 1
        if tp:
            tp["set_parallel_mode"] = True
        head_dim = config.hidden_size // config.num_heads
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, device=device)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.rope = RotaryPositionEmbedding(head_dim).to(device)
        self.layers = nn.ModuleList(
            TransformerLayer(
                config.hidden_size,
                config.ffn_hidden_size,
                config.num_heads,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                self_attn_mask_type="causal",
                normalization="RMSNorm",
                activation="gelu",
                attn_input_format="sbhd" if self.sequence_shards > 1 else "bshd",
                layer_number=i + 1,
                device=device,
                **tp,
            )
            for i in range(config.num_layers)
        )
        self.final_norm = RMSNorm(config.hidden_size, device=device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, device=device)

    def forward(self, tokens: Tensor, targets: Tensor, fp8_recipe=None) -> Tensor:
        """Mean next-byte loss: the transformer body under te.autocast, everything under torch.autocast(bf16)."""
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            with fp8_context(fp8_recipe):
                hidden = self.body(tokens)
            return self.head_loss(hidden, targets)

    def body(self, tokens: Tensor) -> Tensor:
        """Embedding and transformer layers: the part that runs under te.autocast. Under sequence
        parallelism `tokens` is this rank's block of the sequence, and the rotary positions span
        the whole sequence, which the attention gathers."""
        x = self.embed(tokens)
        freqs = self.rope(tokens.shape[1] * self.sequence_shards)
        if self.sequence_shards > 1:
            x = x.transpose(0, 1).contiguous()
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=freqs)
        return x.transpose(0, 1) if self.sequence_shards > 1 else x

    def head_loss(self, x: Tensor, targets: Tensor) -> Tensor:
        """Final norm, LM head and mean cross-entropy, in high precision."""
        logits = self.lm_head(self.final_norm(x))
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
