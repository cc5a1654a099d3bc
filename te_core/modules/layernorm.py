"""te.LayerNorm and te.RMSNorm: normalization over the trailing `normalized_shape` dimensions."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..compat.te_state_dict_names import accept_te_norm_extra_state
from ..distributed.tensor_parallel import mark_sequence_parallel
from ._common import (
    reject_unsupported,
    check_bool,
    check_eps,
    check_optional_bool,
    check_input,
    no_torch_autocast,
    normalized_size,
    resolve_device,
    resolve_params_dtype,
)
from ._norm import NormFunction
from ._reset import DeferredInit, resetting
from ._te_order import te_order


class _Norm(DeferredInit, nn.Module):
    normalization = ""

    @te_order("normalized_shape", "eps", "sequence_parallel", "params_dtype", "zero_centered_gamma", "hidden_size")
    def __init__(
        self,
        normalized_shape: Union[None, int, Sequence[int]] = None,
        eps: float = 1e-5,
        sequence_parallel: Optional[bool] = None,
        params_dtype: Optional[torch.dtype] = None,
        zero_centered_gamma: bool = False,
        device: Union[None, str, torch.device] = None,
        **kwargs,
    ):
        super().__init__()
        self.register_load_state_dict_pre_hook(accept_te_norm_extra_state)  # Transformer Engine checkpoints
        if "hidden_size" in kwargs:  # Transformer Engine's older name for normalized_shape
            hidden_size = kwargs.pop("hidden_size")
            if normalized_shape is not None and hidden_size is not None:
                raise ValueError(f"{type(self).__name__}: give normalized_shape or its older name hidden_size, "
                                 "not both")
            normalized_shape = hidden_size if normalized_shape is None else normalized_shape
        name = type(self).__name__
        if "dtype" in kwargs:  # Transformer Engine's newer name for params_dtype
            dtype = kwargs.pop("dtype")
            if params_dtype is not None and dtype is not None and dtype != params_dtype:
                raise ValueError(f"{name}: give dtype or its older name params_dtype, not both "
                                 f"(got {dtype} and {params_dtype})")
            params_dtype = dtype if params_dtype is None else params_dtype
        _check_sm_margin(kwargs.pop("sm_margin", 0), name)
        reject_unsupported(name, **kwargs)
        self.normalized_shape, self._size = normalized_size(normalized_shape, name)
        self.eps = check_eps(eps, module=name)
        self.zero_centered_gamma = check_bool(zero_centered_gamma, name="zero_centered_gamma", module=name)
        # (None, Transformer Engine's default, leaves the parameters unflagged: reset_parameters)
        self.sequence_parallel = check_optional_bool(sequence_parallel, name="sequence_parallel", module=name)
        factory = dict(device=resolve_device(device), dtype=resolve_params_dtype(params_dtype))
        self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
        if self.normalization == "LayerNorm":
            self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory))
        else:
            self.register_parameter("bias", None)
        self._initialize(materialize=False)

    def _initialize(self, *, materialize: bool = True) -> None:
        with resetting(self, materialize=materialize) as params:
            nn.init.constant_(params["weight"], 0.0 if self.zero_centered_gamma else 1.0)
            if "bias" in params:
                nn.init.zeros_(params["bias"])
        # Transformer Engine's legacy sequence_parallel: only a flag on the parameters, which
        # Megatron-LM reads to all-reduce their gradients over the tensor-parallel group (the
        # norm itself computes the same on a shard of the sequence)
        if self.sequence_parallel is not None:
            mark_sequence_parallel(self, [self.weight, self.bias])

    def forward(self, inp: Tensor) -> Tensor:
        name = type(self).__name__
        n = len(self.normalized_shape)
        if not isinstance(inp, Tensor) or inp.dim() < n or tuple(inp.shape[-n:]) != self.normalized_shape:
            shape = tuple(inp.shape) if isinstance(inp, Tensor) else type(inp).__name__
            raise ValueError(f"{name}: inp has shape {shape}; its trailing dimensions must be {self.normalized_shape}")
        x = inp.reshape(*inp.shape[: inp.dim() - n], self._size)
        check_input(x, self._size, module=name, device=self.weight.device)
        # as Transformer Engine's norms: torch.autocast's dtype where it is on, else the
        # parameters' (a bf16 input to fp32 parameters is normalized, and returned, in fp32)
        device_type = x.device.type
        x = x.to(torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else self.weight.dtype)
        with no_torch_autocast(device_type):
            w = self.weight.reshape(self._size)
            b = None if self.bias is None else self.bias.reshape(self._size)
            y = NormFunction.apply(x, w, b, self.eps, self.normalization, self.zero_centered_gamma)
        return y.view(inp.shape)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


def _check_sm_margin(sm_margin, name: str) -> None:
    """Transformer Engine's `sm_margin` (an int, or a dict of ints per pass): multiprocessors its
    kernels leave free for overlapped communication. te-core's norm kernels take no such limit,
    so it only has to be well formed."""
    values = sm_margin.values() if isinstance(sm_margin, dict) else (sm_margin,)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TypeError(f"{name}: sm_margin must be an int >= 0 or a dict of them (per pass), got {sm_margin!r}")


class LayerNorm(_Norm):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta, with gamma = weight (1 + weight when
    zero_centered_gamma). Parameters `weight`, `bias`."""

    normalization = "LayerNorm"


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x^2) + eps) * gamma. Parameter `weight`."""

    normalization = "RMSNorm"
