"""The demo on several processes launched by torchrun: data parallelism (DistributedDataParallel)
over groups of --tp consecutive ranks that split each layer with tensor parallelism, optionally
with sequence parallelism.

    torchrun --nproc-per-node 2 -m te_core.demo                                  # DP=2
    torchrun --nproc-per-node 2 -m te_core.demo --tp 2                           # TP=2
    torchrun --nproc-per-node 4 -m te_core.demo --tp 2 --sequence-parallel       # DP=2 x TP=2, SP

Every run trains on the single-process run's global batch: the data-parallel replicas split its
rows; the ranks of one tensor-parallel group see the same rows (each its block of the sequence
under sequence parallelism). Every rank builds the single-process model from the same seed and
keeps its shard of it, so a parallel run starts from the single-process weights, and its loss
tracks the single-process run's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .model import GPT, GPTConfig

# The projection whose rows are [q; k; v], each block split by heads over the ranks (the other
# split parameters are plain blocks of the dimension the module splits).
_QKV = ("layernorm_qkv.weight", "layernorm_qkv.bias")


def launched_world() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_layout(world: int, tp: int, sequence_parallel: bool, size: str, model: GPTConfig) -> Optional[str]:
    """What makes `world` processes with --tp / --sequence-parallel unable to train `model`, or None."""
    launch = "launch with torchrun --nproc-per-node N -m te_core.demo"
    if tp < 1:
        return f"--tp must be at least 1, got {tp}"
    if sequence_parallel and tp == 1:
        return "--sequence-parallel splits the sequence over the tensor-parallel ranks; it needs --tp 2 or more"
    if world % tp:
        return (f"--tp {tp} must divide the number of processes, {world}"
                + (f" ({launch}, N a multiple of {tp})" if world == 1 else ""))
    dp = world // tp
    if model.batch_size % dp:
        return (f"the {size} model's batch of {model.batch_size} sequences does not split over {dp} data-parallel "
                f"replicas; run a number of replicas that divides {model.batch_size}")
    for what, count in (("attention heads", model.num_heads), ("FFN features", model.ffn_hidden_size)):
        if count % tp:
            return f"--tp {tp} must divide the {size} model's {count} {what}"
    if sequence_parallel and model.seq_len % tp:
        return f"--sequence-parallel: --tp {tp} must divide the {size} model's sequence length {model.seq_len}"
    return None


@dataclass(frozen=True)
class Layout:
    """Where this process sits: rank r is tensor-parallel rank r % tp of data-parallel replica r // tp."""

    world: int
    rank: int
    tp: int
    sequence_parallel: bool

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        sp = " with sequence parallelism" if self.sequence_parallel else ""
        return f"{self.world} processes: data parallel {self.dp} x tensor parallel {self.tp}{sp}"

    def as_dict(self) -> dict:
        return dict(world=self.world, dp=self.dp, tp=self.tp, sequence_parallel=self.sequence_parallel)


def use_local_device(be) -> None:
    """Make the device of torchrun's LOCAL_RANK the backend's current one (a process that first
    touched the default device would hold a context there, on another rank's device)."""
    if be.device_type != "cpu":
        be.device_module.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def start(be, device: torch.device, tp: int, sequence_parallel: bool) -> Tuple["ParallelRun", torch.device]:
    """Join torchrun's processes (the backend's collective library on its device, gloo on a CPU)
    and build the groups; returns the run and this rank's device."""
    world, rank, local_rank = (int(os.environ[k]) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
    if device.type != "cpu":
        device = torch.device(device.type, local_rank)
        module = be.device_module if device.type == be.device_type else torch.get_device_module(device.type)
        module.set_device(device)
    library = "gloo" if device.type == "cpu" else (be.capabilities.distributed_backend or "gloo")
    dist.init_process_group(library, rank=rank, world_size=world)
    layout = Layout(world, rank, tp, sequence_parallel)
    return ParallelRun(layout, device, *_groups(layout)), device


def _groups(layout: Layout):
    """(tensor-parallel group, data-parallel group) of this rank; None where the group would have
    one rank. Every rank creates every group, in the same order, as torch.distributed requires."""
    tp_group = dp_group = None
    if layout.tp > 1:
        for first in range(0, layout.world, layout.tp):
            group = dist.new_group(list(range(first, first + layout.tp)))
            tp_group = group if first <= layout.rank < first + layout.tp else tp_group
    if layout.dp > 1:
        for offset in range(layout.tp):
            ranks = list(range(offset, layout.world, layout.tp))
            group = dist.new_group(ranks)
            dp_group = group if layout.rank in ranks else dp_group
    return tp_group, dp_group


def shard_of(name: str, full: Tensor, shape, rank: int, tp: int) -> Tensor:
    """This rank's block of a parameter of the single-process model (the whole of a replicated one)."""
    if tuple(full.shape) == tuple(shape):
        return full
    if name.endswith(_QKV):  # [q; k; v] with as many kv heads as heads: each block split alike
        return torch.cat([block.chunk(tp)[rank] for block in full.chunk(3)])
    dim = next(d for d, (a, b) in enumerate(zip(full.shape, shape)) if a != b)
    return full.chunk(tp, dim)[rank]


class ParallelRun:
    """The parallel counterpart of train.OneProcess: builds this rank's model and runs the
    collectives of one training step."""

    def __init__(self, layout: Layout, device: torch.device, tp_group, dp_group):
        self.layout, self.device = layout, device
        self.tp_group, self.dp_group = tp_group, dp_group
        self.is_main = layout.is_main
        self._sharded: set = set()  # ids of the parameters split over the tensor-parallel ranks
        self._replicated: List[nn.Parameter] = []  # the others (tensor parallelism only)

    def build(self, config: GPTConfig, device: torch.device) -> nn.Module:
        """The single-process GPT (from the seed set by the caller), this rank's shard of it under
        tensor parallelism, wrapped in DistributedDataParallel over the replicas. The run's
        collectives then serve this model (a previous one's parameters are forgotten)."""
        self._sharded, self._replicated = set(), []
        model = GPT(config, device)
        if self.layout.tp > 1:
            model = self._shard(model, config, device)
        if self.dp_group is not None:
            model = nn.parallel.DistributedDataParallel(model, process_group=self.dp_group)
        return model

    def _shard(self, full: GPT, config: GPTConfig, device: torch.device) -> GPT:
        layout = self.layout
        tensor_parallel = dict(tp_group=self.tp_group, tp_size=layout.tp, sequence_parallel=layout.sequence_parallel)
        model = GPT(config, device, tensor_parallel)
        whole = dict(full.named_parameters())
        tp_rank = layout.rank % layout.tp
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard_of(name, whole[name], param.shape, tp_rank, layout.tp))
                if param.shape == whole[name].shape:
                    self._replicated.append(param)
                else:
                    self._sharded.add(id(param))
        return model

    def local_batch(self, inputs: Tensor, targets: Tensor) -> Tuple[Tensor, Tensor]:
        """This replica's rows of the global batch; its block of each sequence under sequence parallelism."""
        layout = self.layout
        rows = slice(None)
        if layout.dp > 1:
            per_replica = inputs.shape[0] // layout.dp
            first = (layout.rank // layout.tp) * per_replica
            rows = slice(first, first + per_replica)
        inputs, targets = inputs[rows], targets[rows]
        if layout.sequence_parallel:
            inputs, targets = (t.chunk(layout.tp, dim=1)[layout.rank % layout.tp] for t in (inputs, targets))
        return inputs, targets

    def backward(self, loss: Tensor) -> None:
        """Gradients of the global batch's mean loss. Under sequence parallelism each rank's loss
        covers its block of the sequences: the loss of the whole is their mean, and a parameter
        every rank holds whole gets only its block's share, summed here over the group."""
        if not self.layout.sequence_parallel:
            loss.backward()
            return
        (loss / self.layout.tp).backward()
        _all_reduce_coalesced([p.grad for p in self._replicated if p.grad is not None], self.tp_group)

    def clip_grad_norm_(self, params: List[Tensor], max_norm: float) -> None:
        """torch.nn.utils.clip_grad_norm_ of the single-process model: the norm counts each
        tensor-parallel shard once and each replicated parameter once."""
        if self.layout.tp == 1:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
            return
        grads = [p.grad for p in params if p.grad is not None]
        sharded = [p.grad for p in params if p.grad is not None and id(p) in self._sharded]
        replicated = [p.grad for p in params if p.grad is not None and id(p) not in self._sharded]
        squares = _sum_of_squares(sharded, self.device)
        dist.all_reduce(squares, group=self.tp_group)
        norm = (squares + _sum_of_squares(replicated, self.device)).sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, scale)

    def mean_over_ranks(self, values: Tensor) -> Tensor:
        """The mean of `values` over every rank (each rank's loss covers an equal share of the tokens)."""
        total = values.detach().to(self.device).clone()
        dist.all_reduce(total)
        return total / self.layout.world

    def slowest(self, seconds: float) -> float:
        """The longest of the ranks' times: the run took that long."""
        value = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)

    def close(self) -> None:
        dist.destroy_process_group()


def _sum_of_squares(grads: List[Tensor], device: torch.device) -> Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([g.detach().float().square().sum() for g in grads]).sum()


def _all_reduce_coalesced(tensors: List[Tensor], group) -> None:
    """Sum each tensor over `group` in place, one collective per dtype."""
    by_dtype = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        for t, part in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(part.view_as(t))
