"""te.convert_model: swap an existing model's nn.Linear / nn.LayerNorm / RMSNorm layers for
te-core modules in place, keeping their weights.

A norm directly followed by a Linear inside an nn.Sequential becomes one LayerNormLinear (the
Linear's slot becomes nn.Identity); elsewhere the data flow between modules is not known from
the module tree, so norms and Linears are converted one by one.
"""

from __future__ import annotations

import warnings
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .modules.layernorm import LayerNorm, RMSNorm
from .modules.layernorm_linear import LayerNormLinear
from .modules._common import check_bool, check_callable
from .modules.linear import Linear
from .quantization.autocast import _check_recipe

FilterFn = Callable[[nn.Module, str], bool]


def _is_rmsnorm(module: nn.Module) -> bool:
    """torch's nn.RMSNorm, or a Hugging Face-style one (LlamaRMSNorm: `weight` and `variance_epsilon`)."""
    if isinstance(module, RMSNorm):
        return False
    rms_cls = getattr(nn, "RMSNorm", None)
    if rms_cls is not None and isinstance(module, rms_cls):
        return module.weight is not None
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and hasattr(module, "variance_epsilon")
        and not list(module.children())
    )


def _norm_eps(module: nn.Module) -> float:
    eps = getattr(module, "eps", None)
    if eps is None:
        eps = getattr(module, "variance_epsilon", None)
    if eps is None:  # nn.RMSNorm(eps=None) uses the dtype's machine epsilon
        eps = torch.finfo(module.weight.dtype).eps
    return float(eps)


def _is_layernorm(module: nn.Module) -> bool:
    return (
        type(module) is nn.LayerNorm
        and module.elementwise_affine
        and module.bias is not None
        and len(module.normalized_shape) == 1
    )


def _convert_norm(module: nn.Module) -> nn.Module:
    w = module.weight
    if _is_layernorm(module):
        new = LayerNorm(module.normalized_shape, eps=module.eps, params_dtype=w.dtype, device=w.device)
        _copy(new.bias, module.bias)
    else:
        new = RMSNorm(w.shape[0], eps=_norm_eps(module), params_dtype=w.dtype, device=w.device)
    _copy(new.weight, w)
    return new


def _convert_linear(module: nn.Linear) -> Linear:
    w = module.weight
    new = Linear(
        module.in_features, module.out_features, bias=module.bias is not None, params_dtype=w.dtype, device=w.device
    )
    _copy(new.weight, w)
    if module.bias is not None:
        _copy(new.bias, module.bias)
    return new


def _fuse(norm: nn.Module, linear: nn.Linear) -> LayerNormLinear:
    w = linear.weight
    kind = "LayerNorm" if _is_layernorm(norm) else "RMSNorm"
    new = LayerNormLinear(
        linear.in_features,
        linear.out_features,
        eps=_norm_eps(norm),
        bias=linear.bias is not None,
        normalization=kind,
        params_dtype=w.dtype,
        device=w.device,
    )
    _copy(new.layer_norm_weight, norm.weight)
    if kind == "LayerNorm":
        _copy(new.layer_norm_bias, norm.bias)
    _copy(new.weight, w)
    if linear.bias is not None:
        _copy(new.bias, linear.bias)
    return new


@torch.no_grad()
def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src.detach())
    dst.requires_grad_(src.requires_grad)


def _alignment(recipe) -> int:
    """The multiple a Linear's features must have to be converted under `recipe` (1 without a
    recipe): the recipe's GEMM alignment, and at least 16, since tensor-wise FP8 GEMMs of other
    features would pad the weight on every step; such layers stay in high precision, as
    Transformer Engine's conversion in Accelerate leaves them."""
    if recipe is None:
        return 1
    from .quantization.gemm import PAD_TO
    from .quantization.roles import gemm_slots

    state = recipe.make_state(gemm_slots(), torch.device("cpu"))
    return max(PAD_TO, *(state.quantizer(slot.name).gemm_alignment for slot in gemm_slots()))


def _skipped_names(skip) -> frozenset:
    """skip as a set of names: a single string is one name (`in` on a string would match its
    substrings)."""
    names = (skip,) if isinstance(skip, str) else skip
    try:
        names = frozenset(names)
    except TypeError:  # not iterable, or holding unhashable entries
        names = None
    if names is None or not all(isinstance(name, str) for name in names):
        raise TypeError(f"convert_model: skip must be a module name or a sequence of names (str), got {skip!r}")
    return names


def convert_model(
    model: nn.Module,
    recipe=None,
    *,
    module_filter_fn: Optional[FilterFn] = None,
    skip: Sequence[str] = (),
    fuse_norm_linear: bool = True,
) -> nn.Module:
    """Replace nn.Linear, nn.LayerNorm and RMSNorm layers of `model` (in place; returned).

    skip: qualified names (or their last component, e.g. "lm_head") to leave alone; one string is one name.
    module_filter_fn(module, fqn) -> bool: False leaves that module alone.
    recipe: when given, Linears whose in/out features cannot be quantized by it (not multiples
    of its GEMM alignment, 16 or 32) are left in high precision, with one warning naming them.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_model: model must be a torch.nn.Module, got {type(model).__name__}")
    recipe = None if recipe is None else _check_recipe(recipe, "convert_model")
    check_callable(module_filter_fn, name="module_filter_fn", module="convert_model")
    fuse_norm_linear = check_bool(fuse_norm_linear, name="fuse_norm_linear", module="convert_model")
    skip = _skipped_names(skip)
    names = {part for fqn, _ in model.named_modules() for part in (fqn, fqn.rpartition(".")[2])}
    unmatched = sorted(skip - names)
    if unmatched:  # a misspelt name would convert the very layer meant to stay
        warnings.warn(f"convert_model: skip names no module of the model: {', '.join(map(repr, unmatched))} "
                      "(give qualified names, or their last component)", stacklevel=2)
    align = _alignment(recipe)
    left_out: List[str] = []

    def wanted(module: nn.Module, fqn: str) -> bool:
        parts = fqn.split(".")
        if any(".".join(parts[: i + 1]) in skip or parts[i] in skip for i in range(len(parts))):
            return False  # the module or a module containing it is skipped
        return module_filter_fn is None or bool(module_filter_fn(module, fqn))

    def linear_ok(module: nn.Linear, fqn: str) -> bool:
        if module.in_features % align or module.out_features % align:
            left_out.append(f"{fqn} ({module.in_features}->{module.out_features})")
            return False
        return True

    for fqn, parent in list(model.named_modules()):
        _convert_children(parent, fqn, wanted, linear_ok, fuse_norm_linear)
    if left_out:
        warnings.warn(
            f"convert_model: left in high precision (features not multiples of {align}): {', '.join(left_out)}",
            stacklevel=2,
        )
    return model


def _convert_children(parent: nn.Module, prefix: str, wanted, linear_ok, fuse: bool) -> None:
    names: List[Tuple[str, nn.Module]] = list(parent.named_children())
    fused_into: set = set()
    for i, (name, child) in enumerate(names):
        fqn = f"{prefix}.{name}" if prefix else name
        if name in fused_into or not wanted(child, fqn):
            continue
        is_norm = _is_layernorm(child) or _is_rmsnorm(child)
        if is_norm and fuse and isinstance(parent, nn.Sequential) and i + 1 < len(names):
            next_name, nxt = names[i + 1]
            next_fqn = f"{prefix}.{next_name}" if prefix else next_name
            if (
                type(nxt) is nn.Linear
                and nxt.in_features == child.weight.shape[0]
                and wanted(nxt, next_fqn)
                and linear_ok(nxt, next_fqn)
            ):
                setattr(parent, name, _fuse(child, nxt))
                setattr(parent, next_name, nn.Identity())
                fused_into.add(next_name)
                continue
        if is_norm:
            setattr(parent, name, _convert_norm(child))
        elif type(child) is nn.Linear and linear_ok(child, fqn):
            setattr(parent, name, _convert_linear(child))
