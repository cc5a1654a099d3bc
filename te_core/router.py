"""Transformer Engine's MoE router functions (`transformer_engine.pytorch.router`): top-k expert
selection with a score function, the scores behind the load-balancing loss, and that loss.

Transformer Engine runs them as fused kernels; te-core computes them with torch operations, at
Transformer Engine's precision (logits read in float32, scores and intermediate values in
float32, the routing probabilities returned in the logits' dtype), so autograd differentiates
them. The selection rules are those of the unfused router they replace (Megatron-LM's):
- softmax: top-k of the logits then a softmax over the k chosen, or with `use_pre_softmax` a
  softmax over all experts then its top-k;
- sigmoid / sqrtsoftplus (sqrt(softplus(x))): top-k of the scores (plus `expert_bias` for the
  choice only), the chosen scores normalized to sum to 1 when k > 1;
- grouped: with `group_topk`, the experts are split into `num_groups` groups, each group scored
  by the sum of its best topk / group_topk scores, and only the best `group_topk` groups compete;
- `scaling_factor` multiplies the probabilities.
"""
from __future__ import annotations

import enum
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["RoutingMapFormat", "fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss",
           "fused_moe_aux_loss"]

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
BYTEMAP = "bytemap"


class RoutingMapFormat(enum.IntEnum):
    """The routing map's layout, Transformer Engine's values: BYTEMAP a bool [..., num_experts]
    map; BITMAP_U8 uint8 [..., ceil(num_experts / 8)], bit e % 8 of byte e // 8 set where the
    token routes to expert e (least significant bit first)."""

    BYTEMAP = 0
    BITMAP_U8 = 1


_FORMATS = {"bytemap": RoutingMapFormat.BYTEMAP, "bitmap_u8": RoutingMapFormat.BITMAP_U8}


def _routing_map_format(value, name: str) -> RoutingMapFormat:
    """Transformer Engine's spellings: the enum, its int value or its lowercase name."""
    if isinstance(value, str) and value in _FORMATS:
        return _FORMATS[value]
    if isinstance(value, int) and not isinstance(value, bool) and value in iter(RoutingMapFormat):
        return RoutingMapFormat(value)
    raise ValueError(f"{name}: routing_map_format must be 'bytemap' or 'bitmap_u8' (or RoutingMapFormat.BYTEMAP / "
                     f".BITMAP_U8, or their ints 0 / 1), got {value!r}")


def _in_format(routing_map: Tensor, fmt: RoutingMapFormat) -> Tensor:
    """A bool [..., num_experts] map in `fmt`: as it is, or packed 8 experts to a byte, LSB first."""
    if fmt is RoutingMapFormat.BYTEMAP:
        return routing_map
    num_experts = routing_map.shape[-1]
    pad = -num_experts % 8
    bits = torch.nn.functional.pad(routing_map.to(torch.uint8), (0, pad)) if pad else routing_map.to(torch.uint8)
    bits = bits.reshape(*routing_map.shape[:-1], -1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=routing_map.device)
    return (bits * weights).sum(dim=-1, dtype=torch.uint8)


def _check(logits: Tensor, score_function: str, routing_map_format, name: str) -> RoutingMapFormat:
    """The arguments both routing functions take, checked; the routing map's format."""
    if not isinstance(logits, Tensor) or logits.dim() < 2:
        raise ValueError(f"{name}: logits must be [num_tokens, num_experts] (or [..., num_experts]: the leading "
                         f"dimensions are tokens), got {tuple(getattr(logits, 'shape', ()))}")
    if logits.dtype == torch.float64:
        raise ValueError(f"{name}: float64 logits are not supported (as in Transformer Engine); pass float32, "
                         "bfloat16 or float16")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"{name}: score_function must be one of {', '.join(SCORE_FUNCTIONS)}, got {score_function!r}")
    return _routing_map_format(routing_map_format, name)


def _check_topk(topk: int, num_experts: int, name: str) -> None:
    if not 1 <= topk <= num_experts:
        raise ValueError(f"{name}: topk must be in [1, num_experts={num_experts}] (the experts each token is routed "
                         f"to, out of the logits' last dimension), got topk={topk}")


def _check_groups(num_experts: int, topk: int, num_groups: Optional[int], group_topk: Optional[int],
                  name: str) -> None:
    """Grouped top-k (group_topk given): the constraints of Transformer Engine's kernel."""
    if not group_topk:
        return
    if not num_groups or num_experts % num_groups or topk % group_topk:
        raise ValueError(f"{name}: grouped top-k needs num_experts ({num_experts}) divisible by num_groups "
                         f"({num_groups}) and topk ({topk}) divisible by group_topk ({group_topk})")
    if not 1 <= group_topk <= num_groups:
        raise ValueError(f"{name}: group_topk must be in [1, num_groups={num_groups}] (the groups kept per token), "
                         f"got group_topk={group_topk}")
    if topk // group_topk > num_experts // num_groups:
        raise ValueError(f"{name}: the per-group topk (topk // group_topk = {topk} // {group_topk} = "
                         f"{topk // group_topk}) must be in [1, group size={num_experts // num_groups}] "
                         f"(num_experts // num_groups = {num_experts} // {num_groups}); raise group_topk or "
                         "lower topk")


def _scores(logits32: Tensor, score_function: str) -> Tensor:
    if score_function == "softmax":
        return torch.softmax(logits32, dim=-1)
    if score_function == "sigmoid":
        return torch.sigmoid(logits32)
    return F.softplus(logits32).sqrt()


def _topk(scores: Tensor, topk: int, num_groups: Optional[int], group_topk: Optional[int]) -> Tuple[Tensor, Tensor]:
    if not group_topk:
        return torch.topk(scores, k=topk, dim=-1)
    tokens, experts = scores.shape  # (the grouping checked by _check_groups)
    grouped = scores.view(tokens, num_groups, experts // num_groups)  # (experts // num_groups: no rows is fine)
    group_scores = grouped.topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    chosen = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    expert_mask = group_mask.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, experts)
    return torch.topk(scores.masked_fill(~expert_mask, float("-inf")), k=topk, dim=-1)


def fused_topk_with_score_function(logits: Tensor, topk: int, use_pre_softmax: bool, num_groups: Optional[int],
                                   group_topk: Optional[int], scaling_factor: Optional[float], score_function: str,
                                   expert_bias: Optional[Tensor], routing_map_format=BYTEMAP,
                                   topk_indices: Optional[Tensor] = None, qb_histogram: Optional[Tensor] = None,
                                   qb_bin_bounds: Optional[Tensor] = None, qb_histogram_mode: Optional[str] = None):
    """(routing probabilities [num_tokens, num_experts] in the logits' dtype, zero outside each
    token's k experts; routing map, bool of the same shape), by the rules of the module docstring."""
    name = "fused_topk_with_score_function"
    fmt = _check(logits, score_function, routing_map_format, name)
    shape, logits = logits.shape, logits.reshape(-1, logits.shape[-1])  # leading dimensions: tokens
    _check_topk(topk, shape[-1], name)
    _check_groups(shape[-1], topk, num_groups, group_topk, name)
    if topk_indices is not None or any(v is not None for v in (qb_histogram, qb_bin_bounds, qb_histogram_mode)):
        raise NotImplementedError(f"{name}: topk_indices and quantile balancing (qb_*) are not implemented by "
                                  "te-core; leave them None")
    if expert_bias is not None and score_function == "softmax":
        raise ValueError(f"{name}: expert_bias goes with the sigmoid or sqrtsoftplus score function, not softmax")
    x = logits.float()
    if score_function == "softmax":
        if use_pre_softmax:
            probs, indices = _topk(_scores(x, "softmax"), topk, num_groups, group_topk)
        else:
            top, indices = _topk(x, topk, num_groups, group_topk)
            probs = torch.softmax(top, dim=-1)
    else:
        scores = _scores(x, score_function)
        if expert_bias is not None:
            indices = _topk(scores + expert_bias.float(), topk, num_groups, group_topk)[1]
            probs = scores.gather(1, indices)
        else:
            probs, indices = _topk(scores, topk, num_groups, group_topk)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor is not None:  # (0.0 included: Transformer Engine multiplies by any value given)
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs.to(logits.dtype))
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter(1, indices, True)
    return routing_probs.view(shape), _in_format(routing_map.view(shape), fmt)


def fused_compute_score_for_moe_aux_loss(logits: Tensor, topk: int, score_function: str,
                                         routing_map_format=BYTEMAP) -> Tuple[Tensor, Tensor]:
    """(routing map of each token's top-k experts by score, bool; the scores in float32, softmax
    or, for sigmoid / sqrtsoftplus, normalized to sum to 1 over all experts)."""
    name = "fused_compute_score_for_moe_aux_loss"
    fmt = _check(logits, score_function, routing_map_format, name)
    _check_topk(topk, logits.shape[-1], name)
    shape, logits = logits.shape, logits.reshape(-1, logits.shape[-1])  # leading dimensions: tokens
    scores = _scores(logits.float(), score_function)
    if score_function != "softmax":
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    indices = torch.topk(scores, k=topk, dim=-1)[1]
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter(1, indices, True)
    return _in_format(routing_map.view(shape), fmt), scores.view(shape)


def fused_moe_aux_loss(probs: Tensor, tokens_per_expert: Tensor, total_num_tokens: Union[int, Tensor],
                       num_experts: int, topk: int, coeff: float) -> Tensor:
    """The switch load-balancing loss: sum over experts of (the expert's summed probability x its
    token count) x num_experts x coeff / (topk x total_num_tokens^2), a scalar in probs' dtype
    (`total_num_tokens` may be a device tensor: nothing is read back to the host)."""
    if probs.dim() != 2 or tokens_per_expert.numel() != probs.shape[1]:
        raise ValueError(f"fused_moe_aux_loss: probs must be [num_tokens, num_experts] and tokens_per_expert one count "
                         f"per expert, got {tuple(probs.shape)} and {tuple(tokens_per_expert.shape)}")
    for what, value in (("topk", topk), ("num_experts", num_experts)):
        if value <= 0:  # (as Transformer Engine's kernel checks)
            raise ValueError(f"fused_moe_aux_loss: {what} must be a positive int, got {what}={value}")
    # (a device tensor is not read back to check it, as Transformer Engine's graph-safe path does not)
    if not isinstance(total_num_tokens, Tensor) and total_num_tokens <= 0:
        raise ValueError(f"fused_moe_aux_loss: total_num_tokens must be positive (the tokens the loss averages "
                         f"over), got total_num_tokens={total_num_tokens}")
    acc = torch.promote_types(probs.dtype, torch.float32)  # float32 at least
    total = total_num_tokens.to(acc) if isinstance(total_num_tokens, Tensor) else float(total_num_tokens)
    weighted = (probs.to(acc).sum(dim=0) * tokens_per_expert.to(acc)).sum()
    return (weighted * (num_experts * coeff / topk) / (total * total)).to(probs.dtype)
