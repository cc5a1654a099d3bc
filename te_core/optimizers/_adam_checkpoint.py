"""FusedAdam checkpoints in Transformer Engine's form, so that one written by either loads into the other.

Transformer Engine's FusedAdam.state_dict() holds every state in float32 whatever dtype it is kept in
(bf16 moments converted, float16 and FP8 ones unscaled), but for the int16 remainders of
store_param_remainders, which it saves as they are. With master_weights=True it keeps, and saves, a
"master_param" for every parameter of a stepped group, a float32 one too (which it steps in place, so
its saved master is never read). A capturable optimizer's step count is an int32 tensor of shape [1]
on the parameters' device and its lr a float32 tensor; a non-capturable one's are numbers.

`te_form` makes te-core's state dict so; `check_states` refuses, before anything loads and naming the
parameter, a saved state te-core would otherwise have to drop or misread; `restore_group_types` puts
each group's step count and lr in the optimizer's form after a load.
"""
from __future__ import annotations

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def _params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def _names(optimizer):
    """The parameters' names where the groups hold them (torch's named parameters), else None each."""
    names = []
    for group in optimizer.param_groups:
        given = group.get("param_names") or []
        names += [given[i] if i < len(given) else None for i in range(len(group["params"]))]
    return names


def describe(index, param, name=None) -> str:
    named = f" ('{name}')" if name else ""
    return f"parameter {index}{named} (shape {tuple(param.shape)}, {param.dtype})"


def te_form(optimizer, saved: dict) -> dict:
    """torch's `saved` state dict with each state in float32 (remainders as they are) and, with
    master_weights, a float32 master weight for every parameter that has states: a copy of a
    parameter that steps in place (never an alias: torch's distributed checkpoint loads into the
    tensors of a state dict, and would write a saved master into the parameter)."""
    params = _params(optimizer)
    for index, states in list(saved["state"].items()):
        param = params[index]
        converted = {}
        for name, value in states.items():
            if torch.is_tensor(value) and value.dtype != torch.int16 and name in optimizer.name_to_dtype_map:
                value = optimizer.get_unscaled_state(param, name)
            converted[name] = value
        if optimizer.master_weights and "master_param" not in converted:
            converted["master_param"] = optimizer._saved_master(param)
        saved["state"][index] = converted  # (a new dict: torch's is the live state's own)
    return saved


def check_states(optimizer, state_dict: dict) -> None:
    """Raise where a saved state cannot load as what this optimizer keeps: a moment that is not a
    floating-point tensor, a master weight in the other form (int16 remainders against a float32
    master, or the reverse), or a master weight missing from a checkpoint that holds them for other
    parameters (incomplete: the parameter would restart from its rounded value). A checkpoint with
    no master weight at all was saved without master_weights; those start from the parameters."""
    saved_groups, groups = state_dict["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(groups) or any(len(s["params"]) != len(g["params"])
                                               for s, g in zip(saved_groups, groups)):
        return  # torch's load raises for these
    states = state_dict["state"]
    has_masters = any(isinstance(s, dict) and "master_param" in s for s in states.values())
    saved_ids = [i for group in saved_groups for i in group["params"]]
    for saved_id, param, name in zip(saved_ids, _params(optimizer), _names(optimizer)):
        state = states.get(saved_id) or {}
        where = f"{type(optimizer).__name__}.load_state_dict: the state of {describe(saved_id, param, name)}"
        for key in MOMENTS:
            value = state.get(key)
            if value is not None and not (torch.is_tensor(value) and value.is_floating_point()):
                kind = f"a {value.dtype} tensor" if torch.is_tensor(value) else type(value).__name__
                raise ValueError(f"{where} holds {key} as {kind}; a moment is a floating-point tensor")
        _check_master(optimizer, param, state, has_masters, where, saved_id)


def _check_master(optimizer, param, state: dict, has_masters: bool, where: str, saved_id) -> None:
    uses_master = optimizer.master_weights and optimizer._needs_master(param)
    master = state.get("master_param")
    if master is None:
        if uses_master and state and has_masters:
            raise ValueError(f"{where} lacks master_param, its master weight, which the checkpoint holds for other "
                             "parameters: it is incomplete, or saved for another model. This parameter steps "
                             "through its master weight and would restart from its rounded value. Load a complete "
                             "checkpoint, or start this master weight from the parameter's current value by "
                             f"setting state_dict['state'][{saved_id}]['master_param'] = param.float()")
        return
    if not torch.is_tensor(master) or not (master.is_floating_point() or master.dtype == torch.int16):
        kind = f"a {master.dtype} tensor" if torch.is_tensor(master) else type(master).__name__
        raise ValueError(f"{where} holds master_param as {kind}; a master weight is a floating-point tensor (or "
                         "the int16 remainders of store_param_remainders=True)")
    if not uses_master:
        return  # (dropped: this optimizer steps the parameter itself)
    remainders = optimizer._remainders(param)
    if master.dtype == torch.int16 and not remainders:
        instead = ("construct FusedAdam(master_weights=True, store_param_remainders=True) to load it"
                   if param.dtype == torch.bfloat16 else "remainders complete a plain bf16 parameter only")
        raise ValueError(f"{where} holds master_param as int16 remainders (saved with store_param_remainders=True) "
                         f"but this optimizer keeps a float32 master weight for it; {instead}")
    if master.dtype != torch.int16 and remainders:
        raise ValueError(f"{where} holds a {master.dtype} master weight but this optimizer keeps the int16 "
                         "remainders of store_param_remainders=True for it; construct FusedAdam with "
                         "store_param_remainders=False to load it")


def restore_group_types(optimizer) -> None:
    """Each group's step count and lr in the optimizer's form, as Transformer Engine makes them:
    capturable, an int32 tensor of shape [1] and a float32 tensor on the parameters' device (a
    checkpoint loaded to the CPU would otherwise put host arithmetic into every step, which a
    captured graph does not replay); otherwise numbers (a capturable optimizer's checkpoint
    resumed without capturable=True)."""
    for group in optimizer.param_groups:
        device = group["params"][0].device if group["params"] else optimizer._step_device([])
        if "step" in group:
            step = group["step"]
            if optimizer.capturable:
                step = torch.as_tensor(step, device=device)  # (not a torch.device(...) context's device)
                step = step.round() if step.is_floating_point() else step  # (te-core's once were float32)
                group["step"] = step.to(device=device, dtype=torch.int32).reshape(1)
            elif torch.is_tensor(step):
                group["step"] = round(step.item())
        lr = group.get("lr")
        if optimizer.capturable and lr is not None:
            group["lr"] = torch.as_tensor(lr, dtype=torch.float32, device=device)
        elif torch.is_tensor(lr):
            group["lr"] = lr.item()
