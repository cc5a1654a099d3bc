"""Tensor and sequence parallelism of the GEMM modules, around their local computation.

Column-parallel: each rank holds a block of the output features (weight rows, bias). The
input is replicated; its gradient is summed over the ranks. Under sequence parallelism the
input arrives split along the sequence (first) dimension and is all-gathered before the GEMM
(in FP8 where the recipe allows, see te_core.distributed.fp8_gather); its gradient is
reduce-scattered.
Row-parallel: each rank holds a block of the input features (weight columns); the partial
outputs are all-reduced (reduce-scattered along the sequence under sequence parallelism), then
the bias, whole on every rank, is added.

The module's autograd Function computes on its shard exactly as without parallelism (FP8
included); the functions here only decide which collective goes before and after it. The one
collective inside: under sequence parallelism a norm fused with a column-parallel GEMM runs on
the sequence shard, and its output is gathered by the step the Function is given (norm_input).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .collectives import copy_to_tp_region, gather_along_first_dim, reduce_from_tp_region, scatter_reduce_first_dim
from .fp8_gather import gather_along_first_dim_fp8, gathers_fp8
from .groups import check_ranks_agree, group_size
from .norm_gather import SequenceGatherStep
from .random import MODEL_PARALLEL_RNG_TRACKER_NAME

PARALLEL_MODES = (None, "column", "row")


class TensorParallelMixin:
    """Tensor-parallel settings of a module (set by init_tensor_parallel) and Transformer
    Engine's set_tensor_parallel_group()."""

    def set_tensor_parallel_group(self, tp_group) -> None:
        """The process group of this module's tensor-parallel ranks (its size must be tp_size)."""
        check_group_size(type(self).__name__, tp_group, self.tp_size)
        self.tp_group = tp_group
        self.tp_group_initialized = tp_group is not None or self.tp_size == 1

    def collective_group(self):
        """The group collectives run on; a clear error when the module still lacks one. (Not
        `_tp_group`: Megatron-LM's wrappers of Transformer Engine's modules store their process
        group under that name.)"""
        if not self.tp_group_initialized:
            raise RuntimeError(f"{type(self).__name__}: tp_size={self.tp_size} but no tensor-parallel group is set; "
                               "pass tp_group= to the constructor or call module.set_tensor_parallel_group(group)")
        return self.tp_group


def check_group_size(name: str, tp_group, tp_size: int) -> None:
    """A clear error where `tp_group` (None: none given) has not tp_size ranks."""
    if tp_group is not None and group_size(tp_group, name) != tp_size:
        raise ValueError(f"{name}: the tensor-parallel group has {group_size(tp_group, name)} ranks but the "
                         f"module was built with tp_size={tp_size}; pass a group of {tp_size} ranks")


def check_tp_arguments(name: str, tp_size, get_rng_state_tracker) -> None:
    """A clear error for a tp_size that is no positive int, or a tracker getter that is no function."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"{name}: tp_size must be a positive integer, got {tp_size!r}")
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise TypeError(f"{name}: get_rng_state_tracker must be a function returning the tracker "
                        f"(e.g. lambda: tracker), got {type(get_rng_state_tracker).__name__}")


def init_tensor_parallel(module: TensorParallelMixin, name: str, *, tp_group, tp_size: int, parallel_mode,
                         sequence_parallel: bool, get_rng_state_tracker, rng_tracker_name,
                         modes: Sequence = PARALLEL_MODES) -> None:
    """Check and store the tensor-parallel arguments (Transformer Engine's semantics: with a group,
    tp_size defaults to the group's size; sequence parallelism needs tp_size > 1 to mean anything)."""
    if parallel_mode not in modes:
        raise ValueError(f"{name}: parallel_mode={parallel_mode!r}; use one of {', '.join(map(repr, modes))}")
    check_tp_arguments(name, tp_size, get_rng_state_tracker)
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"{name}: sequence_parallel must be True or False, got {sequence_parallel!r}")
    if rng_tracker_name is not None and not isinstance(rng_tracker_name, str):
        raise TypeError(f"{name}: rng_tracker_name must be a string (the name of a state added to the RNG tracker) "
                        f"or None, got {rng_tracker_name!r}")
    if tp_group is not None and tp_size == 1:
        tp_size = group_size(tp_group, name)
    module.tp_size, module.parallel_mode = tp_size, parallel_mode
    module.sequence_parallel = sequence_parallel and tp_size > 1
    module.get_rng_state_tracker, module.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
    module.tp_group, module.tp_group_initialized = None, tp_size == 1
    module._tp_shapes_checked = False
    if tp_group is not None:
        module.set_tensor_parallel_group(tp_group)


def split_size(size: int, tp_size: int, *, what: str, module: str) -> int:
    """This rank's share of a dimension split over tp_size ranks."""
    if size % tp_size:
        raise ValueError(f"{module}: {what}={size} is not divisible by tp_size={tp_size}; each tensor-parallel "
                         f"rank holds {what}/tp_size of it, so choose a multiple of {tp_size}")
    return size // tp_size


def local_features(module, in_features: int, out_features: int, name: str) -> Tuple[int, int]:
    """(in_features, out_features) of this rank's shard of a GEMM module: out_features split in
    the column mode, in_features in the row mode (module.parallel_mode, module.tp_size)."""
    if module.parallel_mode == "column":
        out_features = split_size(out_features, module.tp_size, what="out_features", module=name)
    elif module.parallel_mode == "row":
        in_features = split_size(in_features, module.tp_size, what="in_features", module=name)
    return in_features, out_features


def init_weight(module, init_method: Callable[[Tensor], None], weight: Tensor) -> None:
    """init_method(weight), inside the tracker's fork when the module has a get_rng_state_tracker
    (so each rank draws its own shard)."""
    tracker_fn = getattr(module, "get_rng_state_tracker", None)
    if tracker_fn is None:
        init_method(weight)
        return
    tracker = tracker_of(tracker_fn, type(module).__name__)
    with tracker.fork(module.rng_tracker_name or MODEL_PARALLEL_RNG_TRACKER_NAME):
        init_method(weight)


def tracker_of(get_rng_state_tracker: Callable, module: str):
    """get_rng_state_tracker(), checked: a tracker (an object with fork(name)), not what a getter
    that forgot to return one gives (None) or the tracker's class."""
    tracker = get_rng_state_tracker()
    if isinstance(tracker, type) or not callable(getattr(tracker, "fork", None)):
        raise TypeError(f"{module}: get_rng_state_tracker() returned {tracker!r}, not an RNG states tracker (an object "
                        "with fork(name), e.g. te_core.distributed.RNGStatesTracker()); make the function return "
                        "the tracker instance")
    return tracker


def mark_model_parallel(module) -> None:
    """Transformer Engine's tensor-parallel attributes on a GEMM module's parameters, set whatever
    its parallel mode: on each weight `tensor_model_parallel` True, `partition_dim` 1 for a
    row-parallel weight (split along its input features) and 0 otherwise, `partition_stride` 1;
    on a column-parallel module's biases the same with dim 0. Megatron-LM reads them: a parameter
    without them counts as a copy on every tensor-parallel rank but the first (so gradient norms
    would leave out the other ranks' shards), and its checkpoints shard along partition_dim."""
    row = module.parallel_mode == "row"
    for name, param in module.named_parameters(recurse=False):
        if name.startswith("layer_norm_"):
            continue
        kind = name.rstrip("0123456789")  # (GroupedLinear's weight0, bias1, ...)
        if kind.endswith("weight"):
            model_parallel_attributes(param, 1 if row else 0)
        elif kind.endswith("bias") and module.parallel_mode == "column":
            model_parallel_attributes(param, 0)


def model_parallel_attributes(param: Tensor, dim: int) -> None:
    """`param` is split along `dim` over the tensor-parallel ranks (see mark_model_parallel)."""
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1


def mark_sequence_parallel(module, params: Sequence[Optional[Tensor]]) -> None:
    """Parameters replicated on the ranks whose gradients, under sequence parallelism, each rank
    holds only in part (its sequence shard's share): `param.sequence_parallel` is True, as in
    Transformer Engine; the training loop all-reduces them over tp_group (Megatron-LM does)."""
    for param in params:
        if param is not None:
            param.sequence_parallel = module.sequence_parallel


def _agree_once(module, x: Tensor, group) -> None:
    """The ranks' shapes and dtypes checked at the module's first call. A graph traced by
    torch.compile before any eager call checks on each of its runs: it leaves the flag alone, as
    setting it would make dynamo retrace the step at its second call."""
    if not module._tp_shapes_checked:
        check_ranks_agree(x, group, type(module).__name__)
        if not torch.compiler.is_compiling():
            module._tp_shapes_checked = True


def column_parallel_input(module, x: Tensor, step=None) -> Tensor:
    """The input of a column-parallel GEMM: gathered along the sequence under sequence
    parallelism, else as is with its gradient summed over the ranks. With the module's
    quantization `step`, the gather moves FP8 where the recipe allows, and returns the GEMM's
    "input" operand already quantized. While torch.compile traces, it gathers in high precision:
    a traced quantized operand is no tensor, so no autograd Function can hand it to the module's
    (the GEMM's operand has the same bytes; the gather moves the compute dtype's)."""
    if module.tp_size == 1:
        return x
    group = module.collective_group()
    _agree_once(module, x, group)
    if not module.sequence_parallel:
        return copy_to_tp_region(x, group)
    if step is not None and not torch.compiler.is_compiling() and gathers_fp8(step, "input", group):
        return gather_along_first_dim_fp8(x, step, "input", group)
    return gather_along_first_dim(x, group)


def norm_input(module, x: Tensor, step, slot: str) -> Tuple[Tensor, object, torch.Size]:
    """For a norm feeding a column-parallel GEMM (the GEMM's operand `slot`): (the tensor the norm
    runs on, the step the module's Function runs with, the shape of the GEMM's whole input).
    Under sequence parallelism the norm runs on this rank's shard and the step gathers its output
    (norm_gather.SequenceGatherStep, FP8 where the recipe allows); otherwise the input is
    prepared by column_parallel_input. Traced by torch.compile, the gather inside the module's
    Function is traced with it (the norm's parameters get this shard's gradient, as eager)."""
    if module.tp_size == 1 or not module.sequence_parallel:
        x = column_parallel_input(module, x)
        return x, step, x.shape
    group = module.collective_group()
    _agree_once(module, x, group)
    return x, SequenceGatherStep(step, slot, group), torch.Size((x.shape[0] * module.tp_size, *x.shape[1:]))


class _GradScaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy * ctx.scale, None


def _splits_columns(module) -> bool:
    """Whether the module's first GEMM is split over the ranks by its output features (a
    column-parallel LayerNormLinear; a LayerNormMLP split with set_parallel_mode=True): only
    then does each rank compute part of the norm's gradients. With parallel_mode=None nothing
    is split, whatever tp_group is given, as in Transformer Engine."""
    return module.tp_size > 1 and (module.parallel_mode == "column" or getattr(module, "set_parallel_mode", False))


def replicated_output(module, x: Optional[Tensor]) -> Optional[Tensor]:
    """A tensor every rank computes whole in front of its column-parallel GEMM and hands back to
    the caller (a norm's output, return_layernorm_output). The caller's gradient of it, the same
    on every rank, flows back with the GEMM's partial input gradient and is summed over the
    ranks with it (copy_to_tp_region, replicated_parameter), so it enters divided by tp_size to
    count once. Under sequence parallelism the tensor is this rank's shard, whose gradient joins
    after the reduce-scatter: as it is."""
    if x is None or not _splits_columns(module) or module.sequence_parallel:
        return x
    return _GradScaled.apply(x, 1.0 / module.tp_size)


def gathered_norm_output(module, x: Optional[Tensor], in_shape: torch.Size):
    """(the norm's returned output, its shape): Transformer Engine's
    return_layernorm_output_gathered under sequence parallelism gathers it along the sequence
    (the first dimension of `in_shape`, this rank's input's), its gradient reduce-scattered back
    to each rank's shard as the GEMM's own gathered input's is; otherwise it stays this rank's.
    An all-gather of its own, in the norm output's dtype (the GEMM's input may have travelled in
    FP8)."""
    if x is None or not module.return_layernorm_output_gathered or not _splits_columns(module) \
            or not module.sequence_parallel:
        return x, in_shape
    gathered = gather_along_first_dim(x.reshape(in_shape), module.collective_group())
    return gathered, gathered.shape


def replicated_parameter(module, param: Optional[Tensor]) -> Optional[Tensor]:
    """A parameter every rank holds whole and applies to the replicated (gathered) input, such
    as the norm's weight in front of a column-parallel GEMM: each rank computes only part of
    its gradient. Without sequence parallelism the parts are summed here, so every rank holds
    the whole gradient (as in Transformer Engine); with it they are left to the training loop
    (see mark_sequence_parallel)."""
    if param is None or not _splits_columns(module) or module.sequence_parallel:
        return param
    return copy_to_tp_region(param, module.collective_group())


def row_parallel_output(module, y: Tensor, bias: Optional[Tensor]) -> Tensor:
    """The output of a row-parallel GEMM: the ranks' partial sums reduced (reduce-scattered
    along the sequence under sequence parallelism), then the bias added once."""
    if module.tp_size > 1:
        group = module.collective_group()
        _agree_once(module, y, group)
        y = scatter_reduce_first_dim(y, group) if module.sequence_parallel else reduce_from_tp_region(y, group)
    return y if bias is None else y + bias.to(y.dtype)

