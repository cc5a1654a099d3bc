"""torch.optim.Adam / AdamW checkpoints loaded into FusedAdam.

torch counts steps per parameter (state "step") where FusedAdam, as Transformer Engine's,
counts them per parameter group (group "step"), and torch's groups lack FusedAdam's
`bias_correction`. Loaded as they are, the next step would fail on the missing key, and with it
supplied would restart the bias correction at step 1. `fused_adam_form` moves the count to
the group and fills the missing keys, so the next step continues torch's; what FusedAdam cannot
continue (AMSGrad, maximize, the other weight decay, parameters of one group stepped a different
number of times) is refused, saying what differs.
"""
from __future__ import annotations

NAME = "FusedAdam"


def fused_adam_form(optimizer, state_dict: dict) -> dict:
    """`state_dict` with each group's step count and missing settings in FusedAdam's form (a new
    dict; the given one is left as it is): the count from its parameters' "step" where the group
    has none, and FusedAdam's settings (its defaults' keys) the saved group lacks from this
    optimizer's group of the same index (bias_correction, for torch's). A FusedAdam or
    Transformer Engine state dict comes back unchanged but for new dicts."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys() \
            or len(state_dict["param_groups"]) != len(optimizer.param_groups):
        return state_dict  # (for check_loadable and torch's load to refuse)
    saved_groups, states = state_dict["param_groups"], state_dict["state"]
    groups = []
    for index, (saved, live) in enumerate(zip(saved_groups, optimizer.param_groups)):
        _check_torch_settings(optimizer, saved, index)
        group = dict(saved)
        for key in optimizer.defaults:
            group.setdefault(key, live[key])
        steps = {float(states[i]["step"]) for i in saved["params"] if "step" in states.get(i, {})}
        if len(steps) > 1:
            raise ValueError(f"{NAME}.load_state_dict: the parameters of parameter group {index} were stepped "
                             f"{', '.join(f'{s:g}' for s in sorted(steps))} times (a per-parameter count, as "
                             f"torch.optim keeps); {NAME} keeps one step count per group, as Transformer Engine's, "
                             "so it cannot continue them all: give parameters stepped alike a group of their own")
        if steps and "step" not in group:
            group["step"] = int(steps.pop())
        groups.append(group)
    # (the per-parameter counts now live in the groups; FusedAdam keeps no "step" state)
    states = {i: {k: v for k, v in s.items() if k != "step"} if isinstance(s, dict) else s for i, s in states.items()}
    return {**state_dict, "state": states, "param_groups": groups}


def _check_torch_settings(optimizer, saved: dict, index: int) -> None:
    """torch.optim.Adam(W) settings FusedAdam has no counterpart for, or one that differs."""
    where = f"{NAME}.load_state_dict: parameter group {index} was saved by torch.optim.Adam(W) with"
    for key, instead in (("amsgrad", "AMSGrad (FusedAdam has none, as Transformer Engine's)"),
                         ("maximize", "maximize=True (FusedAdam minimizes)")):
        if saved.get(key):
            raise ValueError(f"{where} {instead}; continue that run with torch.optim")
    decoupled = saved.get("decoupled_weight_decay")  # (False for Adam, True for AdamW; older torch has none)
    if decoupled is not None and bool(decoupled) != optimizer.adam_w_mode and saved.get("weight_decay", 0) != 0:
        kind, mode = ("AdamW's decoupled", "True") if decoupled else ("Adam's L2", "False")
        raise ValueError(f"{where} {kind} weight decay, which this FusedAdam does not apply; construct "
                         f"FusedAdam(adam_w_mode={mode}) to continue it")
