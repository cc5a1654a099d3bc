"""A module's extra state in Transformer Engine's form: one uint8 tensor, empty when there is no
scaling state to keep.

State dicts are saved by tools that take tensors only (safetensors, and Hugging Face's
`save_pretrained` through it), so the entry is a tensor, as Transformer Engine's is. Its bytes
are torch.save's of te-core's checkpoint dict (plain values and CPU tensors, see
state.extra_state) and are read back with torch.load(weights_only=True): loading never runs
code from a checkpoint. Transformer Engine's bytes are a pickle; torch.save's start with a zip
header, which tells the two apart. Loading also takes the dict itself (te-core checkpoints
written before this form, and te_core.distributed.state_dict's DCP entries before they became
text: as_text).
"""
from __future__ import annotations

import base64
import io
from typing import Optional

import torch
from torch import Tensor

_ZIP_HEADER = b"PK\x03\x04"  # torch.save's archives; a pickle starts with its protocol byte instead
_MARKER = "te_core_extra_state"  # names the dict's form, so that another archive is never misread


def _on_cpu(value):
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    return value


def encode(state: Optional[dict]) -> Tensor:
    """The uint8 tensor a module's `get_extra_state` returns for its checkpoint dict (or None)."""
    if state is None:
        return torch.empty(0, dtype=torch.uint8)
    buffer = io.BytesIO()
    torch.save({_MARKER: 1, **_on_cpu(state)}, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


_TEXT_PREFIX = "te_core_extra_state:base64:"


def as_text(state: Tensor) -> str:
    """A tensor `encode` wrote, as text (its bytes in base64, after a marker): the form
    te_core.distributed.state_dict hands to torch's distributed checkpoint, which saves and
    restores a non-tensor value whole (a tensor it loads in place, into one of the same size; a
    dict it splits into entries of their own, which a model whose scaling state is not made yet
    has none of), and which torch.load(weights_only=True) reads back (it refuses bytes objects)."""
    return _TEXT_PREFIX + base64.b64encode(state.detach().to("cpu").contiguous().numpy().tobytes()).decode("ascii")


def from_text(state):
    """`state` as the uint8 tensor of `encode`'s form where it is as_text's text, else as given."""
    if isinstance(state, str) and state.startswith(_TEXT_PREFIX):
        data = base64.b64decode(state[len(_TEXT_PREFIX):])
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return state


def is_encoded(state) -> bool:
    """Whether `state` is a tensor `encode` wrote (empty, or a torch.save archive)."""
    if not (isinstance(state, Tensor) and state.dtype == torch.uint8 and state.dim() == 1):
        return False
    return state.numel() == 0 or bytes(state[:4].tolist()) == _ZIP_HEADER


def decode(state: Tensor, module: str) -> Optional[dict]:
    """The checkpoint dict of a tensor `encode` wrote, None for an empty one; a clear error for
    an archive that is not te-core's extra state."""
    if state.numel() == 0:
        return None
    data = state.detach().to("cpu").contiguous().numpy().tobytes()
    try:
        loaded = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - any unreadable archive gets the same message
        raise ValueError(f"{module}: the extra state could not be read ({type(err).__name__}: {err}); the checkpoint "
                         "is corrupt or not te-core's. Drop the module's '_extra_state' entry from the state dict to "
                         "start its scaling state afresh.") from err
    if not isinstance(loaded, dict) or loaded.pop(_MARKER, None) != 1:
        raise ValueError(f"{module}: the extra state is a torch.save archive of {type(loaded).__name__}, not te-core's "
                         "extra state. Drop the module's '_extra_state' entry from the state dict to start its scaling "
                         "state afresh.")
    return loaded
