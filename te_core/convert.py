"""te.convert_model: swap an existing model's nn.Linear / nn.LayerNorm / RMSNorm layers for
te-core modules in place, keeping their weights.

A norm directly followed by a Linear inside an nn.Sequential becomes one LayerNormLinear (the
Linear's slot becomes nn.Identity); elsewhere the data flow between modules is not known from
the module tree, so norms and Linears are converted one by one (a fused pair still loads a
state dict saved before conversion: _UnfusedKeys). The new modules hold the model's
own parameters (the same Parameter objects), so parameters the model ties together (an LM head
sharing the embedding's weight) stay tied, and optimizers or hooks holding them keep working.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.utils import parametrize

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
    if rms_cls is not None and isinstance(module, rms_cls):  # (over one dimension, as nn.LayerNorm below)
        return module.weight is not None and module.weight.dim() == 1
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


def _convert_norm(module: nn.Module, take) -> nn.Module:
    w = module.weight
    if _is_layernorm(module):
        new = LayerNorm(module.normalized_shape, eps=module.eps, params_dtype=w.dtype, device=w.device)
        take(new, "bias", module.bias)
    else:
        new = RMSNorm(w.shape[0], eps=_norm_eps(module), params_dtype=w.dtype, device=w.device)
    take(new, "weight", w)
    return new


def _convert_linear(module: nn.Linear, take) -> Linear:
    w = module.weight
    new = Linear(
        module.in_features, module.out_features, bias=module.bias is not None, params_dtype=w.dtype, device=w.device
    )
    take(new, "weight", w)
    if module.bias is not None:
        take(new, "bias", module.bias)
    return new


def _fuse(norm: nn.Module, linear: nn.Linear, take) -> LayerNormLinear:
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
    take(new, "layer_norm_weight", norm.weight)
    if kind == "LayerNorm":
        take(new, "layer_norm_bias", norm.bias)
    take(new, "weight", w)
    if linear.bias is not None:
        take(new, "bias", linear.bias)
    return new


class _UnfusedKeys:
    """A fused norm + Linear loads a state dict of the model before conversion too: the norm's
    `<norm>.weight` / `.bias` and the Linear's `<linear>.weight` / `.bias` (saved from the
    unconverted model, or by code that never converted it) are read as the LayerNormLinear's
    `layer_norm_weight` / `layer_norm_bias` / `weight` / `bias`. A class, not a closure: a
    converted model still pickles and deep-copies. The converted model's own state dict keeps
    the LayerNormLinear's (Transformer Engine's) names."""

    def __init__(self, norm: str, linear: str):
        self.norm, self.linear = norm, linear

    def __call__(self, module, state_dict, prefix, *args) -> None:
        norm, linear = f"{prefix}{self.norm}.", f"{prefix}{self.linear}."
        if linear + "weight" not in state_dict:  # the converted layout (or no entry at all): nothing to map
            return
        moves = ((norm + "weight", norm + "layer_norm_weight"), (norm + "bias", norm + "layer_norm_bias"),
                 (linear + "weight", norm + "weight"), (linear + "bias", norm + "bias"))
        for old, new in moves:
            if old in state_dict:
                state_dict[new] = state_dict.pop(old)


@torch.no_grad()
def _take(module: nn.Module, name: str, src: torch.Tensor) -> bool:
    """module's parameter `name` becomes the model's own parameter `src` where both are plain
    Parameters of one shape, dtype and device (see the module docstring): True. Otherwise `src`'s
    value is copied in (an FP8 primary weight made under te.quantized_model_init quantizes it),
    and the parameter stays apart from any `src` was tied to: False."""
    dst = getattr(module, name)
    if (type(dst) is nn.Parameter and type(src) is nn.Parameter
            and (src.shape, src.dtype, src.device) == (dst.shape, dst.dtype, dst.device)):
        setattr(module, name, src)
        return True
    dst.copy_(src.detach())
    dst.requires_grad_(src.requires_grad)
    return False


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
    walk = _Walk(model, skip, module_filter_fn, _alignment(recipe), fuse_norm_linear)
    for fqn, parent in list(model.named_modules()):
        walk.convert_children(parent, fqn)
    walk.warn()
    return model


class _Walk:
    """One conversion: which modules to convert, and what it had to leave as it was, to say so."""

    def __init__(self, model: nn.Module, skip: frozenset, module_filter_fn: Optional[FilterFn], align: int,
                 fuse: bool):
        self.skip, self.module_filter_fn, self.align, self.fuse = skip, module_filter_fn, align, fuse
        counts = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        self.tied = {i for i, n in counts.items() if n > 1}  # parameters the model shares between modules
        self.left_out: Dict[str, None] = {}  # (ordered, once each: a Linear is asked about when fusing too)
        self.untied: List[str] = []
        self.linear_like: List[str] = []
        self.hooked: List[str] = []
        # the dtypes of the model's Linear weights: a norm kept in another one (float32 norms in a
        # bf16 model) returns its input's dtype, where te-core's norms, as TE's, return their
        # parameters' outside torch.autocast, which the next Linear would refuse
        self.linear_dtypes = {m.weight.dtype for m in model.modules() if type(m) is nn.Linear}
        self.own_precision: List[str] = []

    def wanted(self, module: nn.Module, fqn: str) -> bool:
        parts = fqn.split(".")
        if any(".".join(parts[: i + 1]) in self.skip or parts[i] in self.skip for i in range(len(parts))):
            return False  # the module or a module containing it is skipped
        return self.module_filter_fn is None or bool(self.module_filter_fn(module, fqn))

    def linear_ok(self, module: nn.Linear, fqn: str) -> bool:
        if module.in_features % self.align or module.out_features % self.align:
            self.left_out[f"{fqn} ({module.in_features}->{module.out_features})"] = None
            return False
        return True

    def taker(self, fqn: str) -> Callable[[nn.Module, str, torch.Tensor], None]:
        def take(module: nn.Module, name: str, src: torch.Tensor) -> None:
            if not _take(module, name, src) and id(src) in self.tied:
                self.untied.append(f"{fqn}.{name}")
        return take

    def convert_children(self, parent: nn.Module, prefix: str) -> None:
        names: List[Tuple[str, nn.Module]] = list(parent.named_children())
        fused_into: set = set()
        for i, (name, child) in enumerate(names):
            fqn = f"{prefix}.{name}" if prefix else name
            if name in fused_into or not self.wanted(child, fqn):
                continue
            is_norm = _is_layernorm(child) or _is_rmsnorm(child)
            if (is_norm or type(child) is nn.Linear) and _hooked(child):
                self.hooked.append(f"{fqn} ({type(child).__name__})")
                continue
            if is_norm and self.linear_dtypes and child.weight.dtype not in self.linear_dtypes:
                self.own_precision.append(f"{fqn} ({child.weight.dtype})")
                continue
            if is_norm and self.fuse and isinstance(parent, nn.Sequential) and i + 1 < len(names):
                next_name, nxt = names[i + 1]
                next_fqn = f"{prefix}.{next_name}" if prefix else next_name
                if (type(nxt) is nn.Linear and nxt.in_features == child.weight.shape[0] and not _hooked(nxt)
                        and self.wanted(nxt, next_fqn) and self.linear_ok(nxt, next_fqn)):
                    setattr(parent, name, _fuse(child, nxt, self.taker(fqn)))
                    # on the parent: torch hands each child only its own keys
                    parent.register_load_state_dict_pre_hook(_UnfusedKeys(name, next_name))
                    setattr(parent, next_name, nn.Identity())
                    fused_into.add(next_name)
                    continue
            if is_norm:
                setattr(parent, name, _convert_norm(child, self.taker(fqn)))
            elif type(child) is nn.Linear:
                if self.linear_ok(child, fqn):
                    setattr(parent, name, _convert_linear(child, self.taker(fqn)))
            elif _linear_like(child):
                self.linear_like.append(f"{fqn} ({type(child).__name__})")

    def warn(self) -> None:
        if self.untied:  # only under te.quantized_model_init: an FP8 weight cannot be the tied parameter itself
            warnings.warn(f"convert_model: {', '.join(self.untied)} shared a parameter with another part of the "
                          "model (tied weights), but became FP8 primary weights (te.quantized_model_init) of their "
                          "own: they train apart from now on; convert outside quantized_model_init, or skip them, to "
                          "keep the tie", stacklevel=3)
        if self.left_out:
            warnings.warn(f"convert_model: left in high precision (features not multiples of {self.align}): "
                          f"{', '.join(self.left_out)}", stacklevel=3)
        if self.hooked:
            warnings.warn(f"convert_model: left as they are, in high precision: {', '.join(self.hooked)}: modules "
                          "with hooks or parametrizations (weight_norm among them), which a te-core module in their "
                          "place would drop; remove them before converting to convert these, or skip them to "
                          "silence this", stacklevel=3)
        if self.own_precision:
            warnings.warn(f"convert_model: left as they are: {', '.join(self.own_precision)}: norms kept in another "
                          f"dtype than the model's Linear layers ({', '.join(sorted(map(str, self.linear_dtypes)))}), "
                          "which return their input's dtype; te-core's norms, as Transformer Engine's, return their "
                          "parameters' dtype outside torch.autocast, which the next layer would not take", stacklevel=3)
        if self.linear_like:
            warnings.warn(f"convert_model: left as they are, in high precision: {', '.join(self.linear_like)}: "
                          "linear layers that are not torch.nn.Linear itself (a subclass, whose forward may differ, "
                          "or GPT-2's Conv1D, whose weight is transposed); replace them with te.Linear yourself, or "
                          "skip them to silence this", stacklevel=3)


def _hooked(module: nn.Module) -> bool:
    """Whether module has hooks of its own, parametrized tensors (torch.nn.utils.parametrize;
    the older weight_norm is a forward pre-hook) or a forward of its own (Accelerate's hooks):
    what a replacement would silently lose."""
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_state_dict_hooks", "_load_state_dict_pre_hooks")
    # Accelerate's hooks (CPU offload, a device_map) replace the instance's forward and keep the
    # weights elsewhere (_hf_hook), the module's own parameters on the meta device
    wrapped = hasattr(module, "_hf_hook") or "forward" in vars(module)
    return any(getattr(module, h, None) for h in hooks) or parametrize.is_parametrized(module) or wrapped


def _linear_like(module: nn.Module) -> bool:
    """A linear layer convert_model cannot take as nn.Linear: a subclass of it, or a Conv1D
    (Hugging Face's GPT-2 projection: x @ weight + bias with weight (in, out))."""
    if isinstance(module, nn.Linear):
        # (torch's MultiheadAttention reads its out_proj's weight itself: no te.Linear could stand in)
        return type(module) is not nn.modules.linear.NonDynamicallyQuantizableLinear
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
