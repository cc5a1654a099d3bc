"""Argument and checkpoint checks FusedAdam and FusedSGD share: every hyperparameter of every
parameter group (the constructor's and add_param_group's) is a finite-or-inf real number in its
range, a group holds each parameter once and only parameters of a dtype the optimizer steps, and a
loaded state dict is this optimizer's, for these parameters (torch.optim would load a mismatched
one and fail obscurely, or not at all, later)."""
from __future__ import annotations

import math
import numbers
from typing import Dict, Tuple

import torch
from torch.optim.optimizer import required

# name -> (lowest allowed, highest allowed or None, whether the highest is excluded)
Ranges = Dict[str, Tuple[float, object, bool]]


class ParamDtypeError(TypeError, RuntimeError):
    """A parameter of a dtype the optimizer does not step. Transformer Engine's FusedAdam raises
    RuntimeError for one, so code written for it (`except RuntimeError`) catches this too."""


def check_param_dtype(optimizer: str, param, supported, hint: str, where: str = "") -> None:
    """`param` is of a dtype in `supported`, or one no gradient can have (an integer parameter is
    never stepped). `hint` says what to do instead."""
    dtype = param.dtype
    if dtype in supported or not (dtype.is_floating_point or dtype.is_complex):
        return
    names = [str(d) for d in supported]
    raise ParamDtypeError(f"{optimizer}: a parameter{where} (shape {tuple(param.shape)}) is {dtype}; {optimizer} "
                          f"steps {', '.join(names[:-1])} and {names[-1]} parameters only, {hint}")


def scalar(value):
    """A one-element tensor hyperparameter (check_real takes any shape) as a 0-dim view, which
    torch's ops take where they take a number and which broadcasts into a 0-dim parameter; a
    number as it is. (A view: a value the caller changes in place, as an LR scheduler does, is
    still read.)"""
    return value.reshape(()) if torch.is_tensor(value) and value.dim() else value


def check_real(optimizer: str, name: str, value, low: float, high=None, open_high: bool = False,
               where: str = "") -> None:
    """`value` is a real number (or a one-element floating tensor) in [low, high] / [low, high)."""
    if torch.is_tensor(value):
        if value.numel() != 1 or not value.is_floating_point():
            raise TypeError(f"{optimizer}: {name}{where} must be a number or a one-element floating-point tensor, "
                            f"got a {value.dtype} tensor of shape {tuple(value.shape)}")
        if value.device.type != "cpu":
            return  # (reading it would synchronise with the device; its value is the caller's)
        number = value.item()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    else:
        raise TypeError(f"{optimizer}: {name}{where} must be a real number, got {type(value).__name__} {value!r}")
    too_high = high is not None and (number >= high if open_high else number > high)
    if math.isnan(number) or number < low or too_high:
        bound = [f">= {low}"] if low > -math.inf else []
        bound += [] if high is None else [f"{'<' if open_high else '<='} {high}"]
        raise ValueError(f"{optimizer}: {name}{where} must be {' and '.join(bound) or 'a number'}, got {number}")


def listed_params(param_group: dict) -> dict:
    """The group with its parameters in a list: a generator (model.parameters()) is read once, so
    it cannot go to the checks and then to torch's add_param_group, which would find it empty."""
    params = param_group["params"]
    return {**param_group, "params": [params] if torch.is_tensor(params) else list(params)}


def check_group(optimizer: str, group: dict, ranges: Ranges, index=None, dtypes=None) -> None:
    """A parameter group's hyperparameters (defaults filled in), its parameters' uniqueness and,
    given `dtypes` (supported dtypes, what to do instead), their dtypes (index None: the
    constructor's arguments)."""
    where = "" if index is None else f" (parameter group {index})"
    for name, (low, high, open_high) in ranges.items():
        value = group.get(name)
        if value is None or value is required:
            continue  # (a missing lr is torch's error)
        check_real(optimizer, name, value, low, high, open_high, where)
    if "betas" in group:
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{optimizer}: betas{where} must be a pair (beta1, beta2) in [0, 1), got {betas!r}")
        for i, beta in enumerate(betas):
            check_real(optimizer, f"betas[{i}]", beta, 0.0, 1.0, True, where)
    params = group["params"]
    params = [params] if torch.is_tensor(params) else list(params)
    # torch takes named parameters too: (name, parameter) pairs, as model.named_parameters() gives
    params = [p[1] if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) else p for p in params]
    seen = set()
    for param in params:
        if id(param) in seen:
            raise ValueError(f"{optimizer}: parameter group {index} holds a parameter (shape {tuple(param.shape)}) "
                             "more than once, so each step would update it once per occurrence; pass each "
                             "parameter once (e.g. list(dict.fromkeys(params)), or model.parameters(), which "
                             "already drops shared ones)")
        seen.add(id(param))
        if dtypes is not None:
            check_param_dtype(optimizer, param, *dtypes, where=f" of parameter group {index}")


def check_loadable(optimizer, state_dict, *, allowed, required, shaped) -> None:
    """Raise, before anything is loaded, where `state_dict` is no optimizer state dict, or where a
    parameter's saved state has names `optimizer` does not keep, lacks one it needs, or has another
    shape than the parameter (torch's own load checks the group and parameter counts)."""
    name = type(optimizer).__name__
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        keys = sorted(map(str, state_dict))[:6] if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"{name}.load_state_dict: expected an optimizer state dict (keys 'state' and "
                         f"'param_groups', as optimizer.state_dict() returns), got {keys}; a model's "
                         "state dict goes to model.load_state_dict")
    saved_groups, groups = state_dict["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(groups) or any(len(s["params"]) != len(g["params"])
                                               for s, g in zip(saved_groups, groups)):
        return  # torch's load raises for these
    for saved, group in zip(saved_groups, groups):
        names = group.get("param_names") or [None] * len(group["params"])  # (torch's, for named parameters)
        for saved_id, param, param_name in zip(saved["params"], group["params"], names):
            label = f"{saved_id} ('{param_name}')" if param_name else saved_id
            states = state_dict["state"].get(saved_id) or {}
            unknown = sorted(set(states) - set(allowed))
            if unknown:
                raise ValueError(f"{name}.load_state_dict: the state of parameter {label} holds "
                                 f"{', '.join(unknown)}, which {name} does not keep (it keeps "
                                 f"{', '.join(allowed)}); was the checkpoint saved by another optimizer?")
            missing = [key for key in required if key not in states]
            if states and missing:
                raise ValueError(f"{name}.load_state_dict: the state of parameter {label} lacks "
                                 f"{', '.join(missing)}; the checkpoint is incomplete or from another optimizer")
            for key in shaped:
                value = states.get(key)
                if torch.is_tensor(value) and tuple(value.shape) != tuple(param.shape):
                    raise ValueError(f"{name}.load_state_dict: state {key} of parameter {label} has shape "
                                     f"{tuple(value.shape)} but the parameter has {tuple(param.shape)}; was the "
                                     "checkpoint saved for another model, or with the parameters in another order?")
