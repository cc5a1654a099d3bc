"""Transformer Engine's userbuffers entry points under the stand-in, for a feature te-core does
not have: communication overlapped with GEMMs through userbuffers (`initialize_ub`, the modules'
`ub_*` arguments).

Code written for Transformer Engine calls some of these whether or not it overlaps anything:
a training script may ask `device_supports_multicast()` when it is imported and call `destroy_ub()`
when it ends, with overlap switched off too. Those two answer as Transformer Engine
does where no userbuffers exist; `initialize_ub` stays a name the stand-in does not provide, so
that integrations probing `hasattr(module.base, "initialize_ub")` see the feature missing, and
its error (USERBUFFERS_HINT) says what to run instead.
"""
from __future__ import annotations

USERBUFFERS_HINT = (
    "userbuffers (communication overlap) are not supported by te-core: drop the initialize_ub call and leave the "
    "modules' ub_tp_comm_overlap, ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad and "
    "ub_bulk_wgrad at False; tensor and sequence parallelism then run torch.distributed collectives, not "
    "overlapped with the GEMMs")


def device_supports_multicast(device_id: int = -1) -> bool:
    """False: te-core reserves no multicast memory for any device (only userbuffers would use it).
    Transformer Engine's answers for the device `device_id` (-1: the current one)."""
    if isinstance(device_id, bool) or not isinstance(device_id, int):
        raise TypeError(f"device_supports_multicast: device_id must be an int (-1 for the current device), got "
                        f"{type(device_id).__name__}")
    return False


def destroy_ub() -> None:
    """Nothing to release: initialize_ub never succeeds on te-core. Transformer Engine's also
    returns quietly when no userbuffers were made, and code that overlapped nothing calls it."""
