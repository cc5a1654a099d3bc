"""Tensor-parallel MultiheadAttention and TransformerLayer against the single-process block with
the same full weights: the forward output and every gradient of each rank's shard, on fresh
random inputs. Runs inside the ranks of the process pool (see _pool.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from te_core.modules import MultiheadAttention, TransformerLayer

from ._parity import E4M3, E5M2, FP32, RECIPES, _compare, _run, compare_param_grads, randomize, shard

SEQ, BATCH, HIDDEN, FFN, HEADS, GROUPS = 16, 2, 64, 128, 8, 4
QKV = ("layernorm_qkv.weight", "layernorm_qkv.bias", "qkv.weight", "qkv.bias")


@dataclass(frozen=True)
class AttnCase:
    kind: str  # "MultiheadAttention" or "TransformerLayer"
    tp: int
    sp: bool = False
    fuse_qkv: bool = False  # True: TE's interleaved fused layout, per kv group [q heads | k | v]
    input_layernorm: bool = True  # MultiheadAttention only
    recipe: Optional[str] = None  # a key of _parity.RECIPES; None: fp32
    decoder: bool = False  # TransformerLayer only: layer_type="decoder", with cross-attention
    post_ln_residual: bool = False  # TransformerLayer only: apply_residual_connection_post_layernorm
    softmax_type: str = "vanilla"  # attention sinks: "off-by-one" or "learnable" (split with the heads)

    def __str__(self) -> str:
        return (f"{self.kind}{'-decoder' if self.decoder else ''}-tp{self.tp}{'-sp' if self.sp else ''}{'-fused' if self.fuse_qkv else ''}"
                f"{'' if self.input_layernorm else '-no_ln'}{'-post_ln_residual' if self.post_ln_residual else ''}"
                f"{'' if self.softmax_type == 'vanilla' else '-' + self.softmax_type}"
                f"-{self.recipe or 'float32'}")


def build(case: AttnCase, group=None):
    """The full block of `case` without a group, else this rank's tensor-parallel shard."""
    tp = {} if group is None else dict(tp_group=group, tp_size=case.tp, sequence_parallel=case.sp,
                                       set_parallel_mode=True)
    common = dict(num_gqa_groups=GROUPS, fuse_qkv_params=case.fuse_qkv, attention_dropout=0.0,
                  params_dtype=torch.float32, softmax_type=case.softmax_type, **tp)
    if case.kind == "TransformerLayer":
        layer = TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, self_attn_mask_type="causal",
                                 layer_type="decoder" if case.decoder else "encoder",
                                 apply_residual_connection_post_layernorm=case.post_ln_residual, **common)
        return _WithEncoder(layer, case, group) if case.decoder else layer
    return MultiheadAttention(HIDDEN, HEADS, attn_mask_type="causal", input_layernorm=case.input_layernorm, **common)


class _WithEncoder(torch.nn.Module):
    """A decoder layer called on x alone, with a fixed random encoder output (the rank's sequence
    shard of it under sequence parallelism)."""

    def __init__(self, layer, case: AttnCase, group):
        super().__init__()
        self.layer = layer
        encoder = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(19))
        rank = 0 if group is None else dist.get_rank(group)
        self.encoder = _local(case, encoder, rank) if group is not None else encoder

    def forward(self, x):
        return self.layer(x, encoder_output=self.encoder.to(x.device))


def shard_param(case: AttnCase, name: str, full: torch.Tensor, shape, rank: int) -> torch.Tensor:
    """This rank's block of a full parameter: its heads' rows of the QKV projection (of each of
    the q, k and v blocks in the non-interleaved layout), else as the GEMM modules split."""
    d = HIDDEN // HEADS
    if not case.fuse_qkv and name.rsplit("self_attention.", 1)[-1] in QKV:
        blocks = full.split([HEADS * d, GROUPS * d, GROUPS * d])
        return torch.cat([b.chunk(case.tp)[rank] for b in blocks])
    if not case.fuse_qkv and name.rsplit(".", 1)[0].endswith("key_value"):  # [k; v]
        return torch.cat([b.chunk(case.tp)[rank] for b in full.split([GROUPS * d, GROUPS * d])])
    return shard(full, shape, rank, case.tp, gated=False)


def _local(case: AttnCase, t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.chunk(case.tp, 0)[rank] if case.sp else t


def check_attention_parity(ctx, case: AttnCase) -> Optional[str]:
    if ctx.rank >= case.tp:
        return None
    group = ctx.group(case.tp)
    rank = dist.get_rank(group)
    recipe = None if case.recipe is None else RECIPES[case.recipe]
    steps = 1 if recipe is None else 2
    full = build(case)
    randomize(full, seed=13)
    gen = torch.Generator().manual_seed(17)
    device = next(full.parameters()).device
    x, dy = (torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(device) for _ in range(2))
    y_ref, dx_ref, grads_ref = _run(full, x, dy, recipe and recipe(False), steps=steps)

    part = build(case, group)
    full_params = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in part.named_parameters():
            p.copy_(shard_param(case, name, full_params[name], p.shape, rank))
    y, dx, grads = _run(part, _local(case, x, rank), _local(case, dy, rank), recipe and recipe(True), group, steps)

    fwd_tol, bwd_tol = (FP32, FP32) if recipe is None else (E4M3, E5M2)
    if recipe is not None:
        y_hp = _run(full, x, dy, None)[0]
        assert not torch.equal(y, _local(case, y_hp, rank)), "output equals high precision: FP8 did not run"
    scaled = recipe is not None
    _compare(y, _local(case, y_ref, rank), fwd_tol, f"{case} forward", scaled)
    _compare(dx, _local(case, dx_ref, rank), bwd_tol, f"{case} dx", scaled)
    compare_param_grads(part, grads, group, lambda name, p: shard_param(case, name, grads_ref[name], p.shape, rank),
                        bwd_tol, case, scaled)
    return str(case)
