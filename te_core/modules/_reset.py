"""What the modules' construction and reset_parameters() share: writing each parameter's initial
value, Transformer Engine's deferred initialization included.

A module built on device="meta" holds parameters with shapes and no values. Its
reset_parameters() materializes each parameter on the meta device on the backend's device (the
one a module built with device=None uses), writes the values construction writes (the same
code, so the same init functions draw in the same order: under one seed, a module built on meta
and reset equals one built directly), and quantizes the FP8 primary weights of a module built
under quantized_model_init as construction does, keeping their value from before quantization
where preserve_high_precision_init_val asked for it. A parameter that FSDP2's fully_shard made a
DTensor is initialized on its local shard and stays a DTensor of the same mesh and placements,
as in Transformer Engine. A parameter that holds values already is written in place (the same
object: an optimizer or FSDP2 holding it keeps it); an FP8 one is requantized into its buffers.
A replaced parameter keeps the attributes set on it (tensor_model_parallel, partition_dim,
sequence_parallel, ...).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator

import torch
from torch import Tensor, nn

from .._sharded import local_tensor, sharded_like
from ..quantization import high_precision_init
from ..quantization.tensor import QuantizedTensor
from ._common import resolve_device


class DeferredInit:
    """Transformer Engine's reset_parameters(defer_init=False) for a module whose `_initialize()`
    writes its parameters' initial values through `resetting`: `defer_init=True` does nothing."""

    def reset_parameters(self, defer_init: bool = False) -> None:
        """Initialize the parameters as construction does, materializing those on the meta device
        on te-core's device and quantizing FP8 primary weights (quantized_model_init) again, as the
        module docstring says. `defer_init=True` (Transformer Engine's) does nothing."""
        if not defer_init:
            self._initialize()


@contextlib.contextmanager
def resetting(module: nn.Module, *, materialize: bool = True) -> Iterator[Dict[str, Tensor]]:
    """Yields {name: tensor to write the parameter's initial value into} (high precision, under
    torch.no_grad), and puts the values in place on exit. `materialize`: parameters on meta get
    tensors on the backend's device (reset_parameters); False at construction, where a module
    built on meta stays there."""
    target = resolve_device(None) if materialize else None
    # FP8 primary weights constructed with gradients off are for inference: no backward reads
    # their column-wise copy (Transformer Engine does not keep it either)
    inference_only = not materialize and not torch.is_grad_enabled()
    values: Dict[str, Tensor] = {}
    for name, param in module._parameters.items():
        if param is None:
            continue
        local = local_tensor(param)
        device = target if materialize and local.is_meta else local.device
        if isinstance(local, QuantizedTensor) or device != local.device:
            values[name] = torch.empty(local.shape, dtype=local.dtype, device=device)
        else:
            values[name] = local  # written in place
    with torch.no_grad():
        yield values
        _commit(module, values, inference_only)


def _commit(module: nn.Module, values: Dict[str, Tensor], inference_only: bool = False) -> None:
    primary = module.__dict__.get("_fp8_primary", {})
    preserve = getattr(module, "preserves_high_precision_init_val", lambda: False)()
    for name, value in values.items():
        param = module._parameters[name]
        local = local_tensor(param)
        if name in primary or isinstance(local, QuantizedTensor):
            quantized = module.quantize_primary_weight(name, value, local)
            if inference_only:
                quantized.drop_columnwise()
            if (isinstance(local, QuantizedTensor) and type(local) is type(quantized) and not local.is_meta
                    and local.device == quantized.device):
                local._take_payload(quantized)  # (a ShardQuantizer binding is made again at the next all-gather)
                local._quantizer = quantized._quantizer
            else:
                _replace(module, name, param, quantized)
            if preserve and not value.is_meta:
                high_precision_init.keep(local_tensor(module._parameters[name]), value)
        elif value is not local:
            _replace(module, name, param, value)
    if isinstance(getattr(module, "_weight_cache", None), dict):
        module._weight_cache.clear()  # FP8 copies of the old values
    if values and isinstance(getattr(module, "device", None), torch.device):
        module.device = local_tensor(next(iter(module._parameters[n] for n in values))).device


def _replace(module: nn.Module, name: str, old: Tensor, new_local: Tensor) -> None:
    """Parameter `name` holding `new_local`: a DTensor like `old` where it is one."""
    new = nn.Parameter(sharded_like(old, new_local), requires_grad=old.requires_grad)
    for key, value in getattr(old, "__dict__", {}).items():
        if not key.startswith("_"):  # the user's and Megatron-LM's attributes, not the tensor's own
            setattr(new, key, value)
    module._parameters[name] = new
