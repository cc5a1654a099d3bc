"""Transformer Engine's `parameters_split` for Linear and LayerNormLinear.

The weight (and bias) is held as several named parameters, consecutive row blocks of the whole:
parameters_split={"query_": 64, "key_": 64, "value_": 64} gives query_weight, key_weight,
value_weight (and query_bias, ...) in place of weight (and bias); a list or tuple of names splits
the rows equally. Trailing underscores of the names are dropped, as in Transformer Engine, so
its checkpoints load under the same keys. `module.weight` / `module.bias` then read the
concatenation of the parts, and the GEMM's gradient flows back into each part.

The reverse, for a module that keeps one fused parameter but is addressed by Transformer
Engine's part names (MultiheadAttention with fuse_qkv_params=False: `layernorm_qkv.query_weight`):
`expose_row_views` makes those names read as row views of the fused weight and bias.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

Splits = Tuple[Tuple[str, int], ...]


def parse_parameters_split(parameters_split, out_features: int, module: str) -> Optional[Splits]:
    """((name, rows), ...) from TE's dict (name -> rows) or list/tuple of names (equal rows)."""
    if parameters_split is None:
        return None
    if isinstance(parameters_split, dict):
        items = list(parameters_split.items())
    elif isinstance(parameters_split, (list, tuple)) and parameters_split:
        n = len(parameters_split)
        if out_features % n:
            raise ValueError(f"{module}: parameters_split names {n} equal parts, but out_features={out_features} "
                             f"is not divisible by {n}; pass a dict of sizes instead")
        items = [(name, out_features // n) for name in parameters_split]
    else:
        raise TypeError(f"{module}: parameters_split must be a dict of name -> rows or a non-empty list of names, "
                        f"got {parameters_split!r}")
    splits = []
    for name, rows in items:
        if not isinstance(name, str) or not name.rstrip("_").isidentifier():
            raise ValueError(f"{module}: parameters_split name {name!r} is not a valid parameter name prefix")
        if not isinstance(rows, int) or isinstance(rows, bool) or rows <= 0:
            raise ValueError(f"{module}: parameters_split[{name!r}] must be a positive row count, got {rows!r}")
        splits.append((name.rstrip("_"), rows))
    if len({n for n, _ in splits}) != len(splits):
        raise ValueError(f"{module}: parameters_split names {[n for n, _ in splits]} repeat (after dropping '_')")
    if sum(r for _, r in splits) != out_features:
        raise ValueError(f"{module}: parameters_split sizes sum to {sum(r for _, r in splits)}, but "
                         f"out_features={out_features}")
    return tuple(splits)


class ParameterSplitMixin:
    """For an nn.Module with parameters `weight` and `bias` (bias may be None)."""

    def apply_parameters_split(self, parameters_split, module: str) -> None:
        """Replace weight and bias by their named row blocks (no-op for parameters_split=None)."""
        if parameters_split is None:
            return
        # first: under tensor parallelism the local weight holds this rank's rows only, against
        # which sizes given for the whole out_features would read as wrong
        for what, unsupported in (("tp_size > 1", getattr(self, "tp_size", 1) > 1),
                                  ("fuse_wgrad_accumulation=True", getattr(self, "fuse_wgrad_accumulation", False)),
                                  ("FP8 primary weights (quantized_model_init)",
                                   type(self._parameters["weight"].data) is not torch.Tensor)):
            if unsupported:
                raise NotImplementedError(f"{module}: parameters_split with {what} is not supported yet")
        splits = parse_parameters_split(parameters_split, self._parameters["weight"].shape[0], module)
        for suffix in ("weight", "bias"):
            whole = self._parameters.pop(suffix, None)
            if whole is None:
                continue
            parts = whole.detach().split([rows for _, rows in splits])
            for (name, _), part in zip(splits, parts):
                self.register_parameter(f"{name}_{suffix}", nn.Parameter(part.clone(), whole.requires_grad))
        self._parameters_split = splits

    def whole_of(self, params: Dict[str, Tensor], suffix: str) -> Optional[Tensor]:
        """What reset_parameters writes the whole `suffix` ("weight" / "bias") into: its tensor in
        `params` (_reset.resetting's), or with parameters_split a new one to split into the parts
        (store_split); None for a module without it."""
        splits = self.__dict__.get("_parameters_split")
        if splits is None:
            return params.get(suffix)
        part = params.get(f"{splits[0][0]}_{suffix}")
        if part is None:
            return None
        return part.new_empty((sum(rows for _, rows in splits), *part.shape[1:]))

    def store_split(self, params: Dict[str, Tensor], **wholes: Optional[Tensor]) -> None:
        """After writing into the concatenated `weight=` / `bias=` (reset_parameters), copy the
        rows into the named parts' tensors in `params`; nothing to do without parameters_split."""
        splits = self.__dict__.get("_parameters_split")
        if splits is None:
            return
        with torch.no_grad():
            for suffix, whole in wholes.items():
                if whole is not None:
                    for (name, _), part in zip(splits, whole.split([rows for _, rows in splits])):
                        params[f"{name}_{suffix}"].copy_(part)

    def expose_row_views(self, splits: Splits) -> None:
        """`{name}_weight` / `{name}_bias` of each (name, rows) of `splits` read as views of those
        rows of the fused weight and bias (writes through them write the parameter)."""
        views, start = {}, 0
        for name, rows in splits:
            for suffix in ("weight", "bias"):
                views[f"{name}_{suffix}"] = (suffix, start, rows)
            start += rows
        self._row_views = views

    def __getattr__(self, name: str):
        splits = self.__dict__.get("_parameters_split")
        if splits is not None and name in ("weight", "bias"):
            parts = [self._parameters.get(f"{n}_{name}") for n, _ in splits]
            return None if parts[0] is None else torch.cat(parts)
        try:
            return super().__getattr__(name)
        except AttributeError:  # (looked up only then: every parameter read comes through here)
            view = self.__dict__.get("_row_views", {}).get(name)
            if view is None:
                raise
        whole = getattr(self, view[0])
        return None if whole is None else whole.narrow(0, view[1], view[2])
