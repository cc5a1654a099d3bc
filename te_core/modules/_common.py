"""Shared plumbing of the modules: where parameters live, which dtype a forward computes in,
and the input checks whose messages name the offending argument."""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import operator
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .._flags import flag, optional_flag
from ..backend.types import as_dtype
from ..ops import ACTIVATIONS, GATED_ACTIVATIONS
from ..quantization import high_precision_init

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# Transformer Engine arguments te-core accepts only at these values, grouped by why the others
# are not implemented; any other value raises NotImplementedError naming the argument.
_NOT_IMPLEMENTED = {
    "tensor, sequence or context parallelism": {
        "sequence_parallel": (None, False), "tp_group": (None,), "tp_size": (1,), "get_rng_state_tracker": (None,),
        "rng_tracker_name": (None,), "parallel_mode": (None, "column", "row"), "set_parallel_mode": (False,),
        "cp_group": (None,), "cp_global_ranks": (None,),
        "cp_stream": (None,), "cp_comm_type": ("p2p",),
    },
    "userbuffers communication overlap": {
        "ub_tp_comm_overlap": (False,), "ub_overlap_ag": (False,), "ub_overlap_rs": (False,),
        "ub_overlap_rs_dgrad": (False,), "ub_bulk_dgrad": (False,), "ub_bulk_wgrad": (False,),
    },
    "FP8 tensors passed between modules": {"fp8_output": (False,), "fp8_grad": (False,)},
    "attention variants": {
        "score_mod": (None,), "score_mod_bprop": (None,), "score_mod_tensors": (None,),
        "score_mod_bprop_tensors": (None,),
    },
}
UNSUPPORTED_DEFAULTS = {name: allowed for group in _NOT_IMPLEMENTED.values() for name, allowed in group.items()}
_REASON = {name: reason for reason, group in _NOT_IMPLEMENTED.items() for name in group}


def reject_unsupported(module: str, **kwargs) -> None:
    """TypeError for an argument Transformer Engine does not have; NotImplementedError for one
    te-core does not implement beyond its default."""
    for name, value in kwargs.items():
        if name not in UNSUPPORTED_DEFAULTS:
            raise TypeError(f"{module} got an unexpected keyword argument {name!r}")
        allowed = UNSUPPORTED_DEFAULTS[name]
        if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            raise NotImplementedError(
                f"{module}: {name}={value!r} is not supported by te-core yet ({_REASON[name]} are not "
                f"implemented); leave it at {allowed[0]!r}"
            )


def check_ub_name(ub_name, module: str) -> Optional[str]:
    """Transformer Engine's `ub_name`: the name of the module's userbuffers, read only with an
    ub_overlap_* flag set (which te-core refuses). Megatron-LM passes one to every module it
    builds, with the flags off; kept as the module's `ub_name` attribute, as TE keeps it."""
    if ub_name is not None and not isinstance(ub_name, str):
        raise TypeError(f"{module}: ub_name must be a string or None, got {type(ub_name).__name__}")
    return ub_name


def check_name(name, module: str) -> Optional[str]:
    """A module's `name` (Transformer Engine's label for its debug tools, which te-core keeps as
    the `name` attribute and hands on to submodules as TE does): None or a string."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{module}: name must be a string or None, got {type(name).__name__}")
    return name


def sub_name(name: Optional[str], suffix: str) -> Optional[str]:
    """A submodule's name under Transformer Engine's scheme: the parent's plus `.suffix`."""
    return None if name is None else f"{name}.{suffix}"


def check_warmup_sizes(module: str, seq_length, micro_batch_size) -> None:
    """Transformer Engine's seq_length / micro_batch_size, which only size the warm-up of its
    TorchScript fusions (and userbuffers, which te-core does not have): they change no result,
    here or there (a TransformerLayer under sequence parallelism also checks its input's length
    against seq_length, as TE's does). None or positive ints."""
    for arg, value in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{module}: {arg} must be a positive int or None, got {value!r}")


SYMMETRIC_AR_TYPES = (None, "multimem_all_reduce", "two_shot", "one_shot")


def check_symmetric_ar_type(value, module: str):
    """Transformer Engine's symmetric_ar_type: which symmetric-memory kernel runs a row-parallel
    forward all-reduce, a latency choice. te-core runs torch.distributed's all-reduce for every
    value (the same sums; the order of the additions may differ)."""
    if value not in SYMMETRIC_AR_TYPES:
        raise ValueError(f"{module}: symmetric_ar_type must be one of {', '.join(map(repr, SYMMETRIC_AR_TYPES))}, "
                         f"got {value!r}")
    return value


def resolve_device(device: Union[None, str, torch.device]) -> torch.device:
    """`device`, or the selected backend's device when None (CPU under the reference backend)."""
    from .. import backend

    if device is not None:  # a device this torch build cannot use is a clear error here
        return backend.require_device(device)
    return backend.get_backend().device


def resolve_params_dtype(params_dtype: Optional[torch.dtype]) -> torch.dtype:
    """`params_dtype`, or torch's default dtype (float32 unless changed), as Transformer Engine."""
    dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
    if dtype not in HP_DTYPES:
        raise TypeError(f"params_dtype={dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    return dtype


def default_init_method(std: float = 0.023) -> Callable[[Tensor], None]:
    """Transformer Engine's default weight init: normal(0, 0.023). A partial of a module-level
    function, not a closure: modules keep it as an attribute, and a closure would make them
    unpicklable (torch.save(model), multiprocessing)."""
    return functools.partial(_normal_init, std=std)


def _normal_init(weight: Tensor, std: float) -> None:
    torch.nn.init.normal_(weight, mean=0.0, std=std)


def compute_dtype(x: Tensor, module: Optional[torch.nn.Module] = None) -> torch.dtype:
    """The dtype a module computes in: torch.autocast's when enabled for x's device, else x's,
    which must then be the dtype of each of `module`'s own parameters, as Transformer Engine
    and torch's layers require (computing in x's dtype would silently round the parameters to it,
    or compute a low-precision input's layer in float32)."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if module is not None:
        dtype = x.dtype
        for name, param in module._parameters.items():
            if param is not None and param.dtype != dtype:
                raise TypeError(
                    f"{type(module).__name__}: the input is {dtype} but the parameter {name!r} is {param.dtype}; "
                    "outside torch.autocast the input and the parameters must have one dtype (as in Transformer "
                    f"Engine): cast the input (x.to({param.dtype})) or the module (module.to({dtype})), or run it "
                    "under torch.autocast")
    return x.dtype


def returned_bias(bias: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """A bias returned unapplied (return_bias=True), in the module's compute dtype as Transformer
    Engine returns it, so that adding it keeps the output's dtype; None stays None. The cast is
    differentiable: the gradient reaches the parameter in its own dtype."""
    return None if bias is None else as_dtype(bias, dtype)


def no_torch_autocast(device_type: str):
    """Modules cast operands themselves; torch.autocast must not re-cast inside the ops."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def cast_if_needed(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    if t is None or t.dtype == dtype:
        return t
    return t.to(dtype)


def primary_weight(module, slot: str, weight: torch.nn.Parameter, name: Optional[str] = None) -> torch.nn.Parameter:
    """Under te.quantized_model_init: the initialized weight stored only in FP8 (carrying its value
    from before quantization with preserve_high_precision_init_val=True), else as is. For a
    QuantizedModule of one's own: the weight is recorded as parameter `name` (default: `slot`), so
    that reset_parameters quantizes it again (te-core's modules record theirs themselves)."""
    if not module.note_primary_weights(**{name or slot: slot}):
        return weight
    quantized = module.quantize_primary_weight(name or slot, weight.detach())
    if not torch.is_grad_enabled():  # built for inference: no backward reads the column-wise copy
        quantized.drop_columnwise()
    stored = torch.nn.Parameter(quantized, requires_grad=weight.requires_grad)
    if module.preserves_high_precision_init_val() and not weight.is_meta:  # (on meta: at reset_parameters)
        high_precision_init.keep(stored, weight)
    return stored


def hp_weight(step, weight: Tensor, dtype: torch.dtype) -> Tensor:
    """The weight as a GEMM operand source: as stored under FP8 (quantized from its own
    precision), cast to the compute dtype otherwise."""
    return weight if step.fp8 else weight.to(dtype)


def check_fp8_gemms(step, module: str, *gemms: Tuple[int, int, int]) -> None:
    """Before anything is quantized: each (M, N, K) must suit the recipe's FP8 GEMMs."""
    try:
        for m, n, k in gemms:
            step.check_gemm_dims(m, n, k)
    except ValueError as err:
        raise ValueError(f"{module}: {err}") from None


def check_input(x: Tensor, last_dim: int, *, name: str = "inp", module: str = "module",
                last_dim_name: str = "", device: Optional[torch.device] = None) -> None:
    """A floating-point tensor with at least 1 dimension whose last dimension is `last_dim`
    (called `last_dim_name` in the message), on `device` (the weights') when given."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{module}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HP_DTYPES:
        raise TypeError(
            f"{module}: {name} has dtype {x.dtype}; expected float32, bfloat16 or float16 "
            "(FP8 quantization happens inside the module under te.autocast)"
        )
    if x.dim() == 0 or x.shape[-1] != last_dim:
        what = f"{last_dim_name}={last_dim}" if last_dim_name else f"{last_dim} (the module's input features / hidden size)"
        raise ValueError(f"{module}: {name} has shape {tuple(x.shape)}; its last dimension must be {what}")
    if device is not None and device.type == "meta":
        raise RuntimeError(
            f"{module}: its parameters are on the meta device (built with device='meta'), which holds no values to "
            "compute with; materialize and initialize them first: module.to_empty(device=...) then "
            "module.reset_parameters() (reset_parameters() alone materializes them on te-core's device), or build "
            "the module on a device")
    if device is not None and x.device != device:
        raise ValueError(
            f"{module}: {name} is on {x.device} but the weight is on {device}; move one of them "
            f"({name}.to({str(device)!r}) or module.to(...))"
        )
    check_not_meta(x, name=name, module=module)


def check_not_meta(x: Tensor, *, name: str, module: str) -> None:
    """A meta tensor has a shape but no data: computing on it fails deep inside torch, or gives
    memory never written."""
    if x.is_meta:
        raise ValueError(f"{module}: {name} is on the meta device, which holds no data to compute on; pass tensors "
                         "on the model's device (a model built on meta needs module.to_empty(device=...) and its "
                         "weights initialized first)")


def check_choice(value: str, allowed: Sequence[str], *, name: str, module: str) -> str:
    if value not in allowed:
        raise ValueError(f"{module}: unknown {name}={value!r}; choose one of {', '.join(map(repr, allowed))}")
    return value


def check_activation(activation: str, module: str) -> str:
    return check_choice(activation, ACTIVATIONS, name="activation", module=module)


def check_normalization(normalization: str, module: str) -> str:
    return check_choice(normalization, NORMALIZATIONS, name="normalization", module=module)


def is_gated(activation: str) -> bool:
    return activation in GATED_ACTIVATIONS


def check_bool(value, *, name: str, module: str) -> bool:
    """A flag as a Python bool (te_core._flags: bool, numpy's bool, 0 or 1), else a TypeError."""
    return flag(value, name, module)


def check_optional_bool(value, *, name: str, module: str) -> Optional[bool]:
    """A flag documented as Optional[bool]: None, or check_bool's values."""
    return optional_flag(value, name, module)


def check_bools(module: str, **flags) -> Tuple[bool, ...]:
    """check_bool of each keyword, as a tuple in the order given."""
    return tuple(flag(value, name, module) for name, value in flags.items())


def check_callable(value, *, name: str, module: str, optional: bool = True):
    """A callable (or None, where `optional`): an object called later fails there, far from its cause."""
    if (value is None and optional) or callable(value):
        return value
    what = "a callable or None" if optional else "a callable"
    raise TypeError(f"{module}: {name} must be {what}, got {value!r} ({type(value).__name__})")


def _check_real(value, *, name: str, module: str, what: str) -> float:
    # (bool is a numbers.Real, but True is no epsilon or probability)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{module}: {name} must be {what}, got {value!r} ({type(value).__name__})")
    return float(value)


def check_positive_finite(value, *, name: str, module: str) -> float:
    """A positive finite real (a softmax scale, a rotary base or fraction)."""
    number = _check_real(value, name=name, module=module, what="a positive finite number")
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{module}: {name} must be positive and finite, got {value!r}")
    return number


def check_eps(value, *, name: str = "eps", module: str) -> float:
    """A norm's epsilon: a finite real >= 0 (it is added to the variance; 0 is taken, as
    Transformer Engine and torch take it, though a row without variance then normalizes to NaN)."""
    eps = _check_real(value, name=name, module=module, what="a finite number >= 0")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{module}: {name} must be finite and >= 0, got {value!r}")
    return eps


def check_probability(value, *, name: str, module: str, closed: bool = False) -> float:
    """A dropout probability: a real in [0, 1) (1 would drop everything and scale by 1/0), or
    in [0, 1] where `closed` (a drop that at 1 keeps nothing and scales nothing)."""
    span = "[0, 1]" if closed else "[0, 1)"
    p = _check_real(value, name=name, module=module, what=f"a number in {span}")
    if not (0.0 <= p <= 1.0 if closed else 0.0 <= p < 1.0):
        raise ValueError(f"{module}: {name} must be in {span}, got {value!r}")
    return p


def _as_int(value) -> Optional[int]:
    """value as a plain int where it is an integer (a numpy or 0-d torch integer included, as
    torch.empty takes them in Transformer Engine's modules), else None; never a bool."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_positive(value: int, *, name: str, module: str) -> int:
    as_int = _as_int(value)
    if as_int is None or as_int <= 0:
        raise ValueError(f"{module}: {name} must be a positive integer, got {value!r}")
    return as_int


def check_divisible(numerator: int, denominator: int, *, what: str, by: str, module: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{module}: {what}={numerator} is not divisible by {by}={denominator}")
    return numerator // denominator


def normalized_size(normalized_shape: Union[int, Sequence[int]], module: str) -> Tuple[Tuple[int, ...], int]:
    """(shape tuple, number of elements normalized together)."""
    single = not isinstance(normalized_shape, (tuple, list, torch.Size))
    sizes = [_as_int(s) for s in ((normalized_shape,) if single else normalized_shape)]
    if not sizes or any(s is None or s <= 0 for s in sizes):
        raise ValueError(
            f"{module}: normalized_shape must be a positive int or a tuple of them, got {normalized_shape!r}"
        )
    shape = tuple(sizes)
    return shape, math.prod(shape)


def check_split_sizes(split_sizes, total: int, module: str) -> Tuple[int, ...]:
    """split_sizes as a tuple of positive ints summing to `total` (the output features)."""
    if not isinstance(split_sizes, (tuple, list)):
        raise TypeError(f"{module}: split_sizes must be a list or tuple of positive integers summing to "
                        f"out_features={total}, got {split_sizes!r}")
    sizes = tuple(split_sizes)
    if not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise ValueError(f"{module}: split_sizes must be positive integers, got {split_sizes!r}")
    if sum(sizes) != total:
        raise ValueError(f"{module}: split_sizes {list(sizes)} sum to {sum(sizes)}, not out_features={total}")
    return sizes


def _row_count(value) -> int:
    # (operator.index takes True as 1; isinstance first: a traced int has no dtype to ask for)
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError
    if isinstance(value, (int, torch.SymInt)):  # as it is: a traced count stays symbolic, where
        return value  # operator.index would specialize the graph to it (a recompile per split)
    return operator.index(value)  # numpy's ints and integer tensors' elements; not floats


def check_m_splits(m_splits, count: int, rows: Optional[int], module: str, what: str = "inp") -> List[int]:
    """A grouped GEMM's m_splits as `count` non-negative ints (rows per GEMM) summing to `rows`,
    the rows of `what` (any sum where None)."""
    try:
        splits = [_row_count(m) for m in m_splits]
    except TypeError:
        raise TypeError(f"{module}: m_splits must be a list of {count} non-negative ints (the rows of each GEMM, "
                        f"num_gemms={count}), got {m_splits!r}") from None
    if len(splits) != count or any(m < 0 for m in splits):
        raise ValueError(f"{module}: m_splits must be {count} non-negative row counts (num_gemms), got {splits}")
    if rows is not None and sum(splits) != rows:
        raise ValueError(f"{module}: m_splits sum to {sum(splits)} but {what} has {rows} rows (tokens)")
    return splits


def check_attention_heads(module: str, num_attention_heads: int, num_gqa_groups: Optional[int],
                          hidden_size: Optional[int] = None, kv_channels: Optional[int] = None):
    """(heads, kv groups, kv_channels), checked as every attention block needs them: positive
    counts, heads a multiple of the groups (default: one group per head), and kv_channels
    defaulting to hidden_size / heads, which must then divide."""
    check_positive(num_attention_heads, name="num_attention_heads", module=module)
    groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
    check_positive(groups, name="num_gqa_groups", module=module)
    check_divisible(num_attention_heads, groups, what="num_attention_heads", by="num_gqa_groups", module=module)
    if kv_channels is not None:
        check_positive(kv_channels, name="kv_channels", module=module)
    elif hidden_size is not None:
        check_positive(hidden_size, name="hidden_size", module=module)
        if hidden_size % num_attention_heads:
            raise ValueError(f"{module}: hidden_size={hidden_size} is not divisible by num_attention_heads="
                             f"{num_attention_heads}; pass kv_channels (the size of each head) to choose it")
        kv_channels = hidden_size // num_attention_heads
    return num_attention_heads, groups, kv_channels
