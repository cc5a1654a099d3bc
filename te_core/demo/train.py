"""One training run of the demo GPT: BF16 (torch.autocast) or FP8 (te.autocast with a recipe
inside the same torch.autocast), with identical initialization and data order."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from ..modules import init_quantization_state
from .capture import LayerCalls, capture_layers
from .data import BatchSampler
from .model import GPT, GPTConfig
from .progress import ProgressBar

RECIPES = ("delayed", "current", "block", "mxfp8")

# Steps left out of the steady-state tokens/s: a compiled run's first step runs eagerly (below),
# torch.compile compiles on the second, CUDA graphs (mode="reduce-overhead") warm up there and
# record on the third, and eager runs JIT-compile and autotune their Triton kernels on the first
# calls. None of it recurs in a longer run.
SETTLE = 3


def make_recipe(name: str):
    """The te-core recipe object for a --recipe name."""
    from .. import recipe

    factories = {
        "delayed": lambda: recipe.DelayedScaling(),
        "current": lambda: recipe.Float8CurrentScaling(),
        "block": lambda: recipe.Float8BlockScaling(),
        "mxfp8": lambda: recipe.MXFP8BlockScaling(),
    }
    if name not in factories:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return factories[name]()


@dataclass
class RunConfig:
    model: GPTConfig
    steps: int
    lr: float = 2e-3
    warmup: int = 0  # 0: 10% of the steps
    weight_decay: float = 0.1
    seed: int = 1234
    eval_batches: int = 4


@dataclass
class RunResult:
    name: str
    losses: List[float] = field(default_factory=list)
    val_loss: float = float("nan")
    seconds: float = 0.0  # the whole run, first steps included
    tokens_per_s: float = 0.0
    steady_seconds: float = float("nan")  # the steps after the first SETTLE; NaN when there are none
    steady_tokens_per_s: float = float("nan")

    def as_dict(self) -> dict:
        return dict(
            name=self.name,
            losses=self.losses,
            val_loss=self.val_loss,
            seconds=self.seconds,
            tokens_per_s=self.tokens_per_s,
            steady_seconds=self.steady_seconds,
            steady_tokens_per_s=self.steady_tokens_per_s,
        )


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    warmup = cfg.warmup or max(1, cfg.steps // 10)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


class OneProcess:
    """The single-process run; te_core.demo.parallel.ParallelRun does the same across torchrun's ranks."""

    is_main = True
    layout = None  # a parallel run's te_core.demo.parallel.Layout

    def build(self, config: GPTConfig, device: torch.device) -> GPT:
        return GPT(config, device)

    def local_batch(self, inputs: torch.Tensor, targets: torch.Tensor):
        return inputs, targets

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm_(self, params, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    def mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def slowest(self, seconds: float) -> float:
        return seconds


ONE_PROCESS = OneProcess()


def loss_of(model, inputs: torch.Tensor, targets: torch.Tensor, device: torch.device, fp8_recipe) -> torch.Tensor:
    """Mean next-byte loss (GPT.forward; `model` may be its DistributedDataParallel wrapper)."""
    return model(inputs, targets, fp8_recipe)


def train(
    name: str,
    cfg: RunConfig,
    train_tokens,
    val_tokens,
    device: torch.device,
    fp8_recipe=None,
    progress: bool = True,
    synchronize: Callable[[], None] = lambda: None,
    compile_options: Optional[dict] = None,
    runner: OneProcess = ONE_PROCESS,
    capture: bool = False,
) -> RunResult:
    """Train a freshly initialized GPT for cfg.steps steps; returns per-step losses and speed.
    `synchronize` waits for the device's queued work, so the timing covers all of it.
    `compile_options`: torch.compile's arguments for the loss step (None: eager); `seconds` and
    `tokens_per_s` include the compilation, as a user's run would, `steady_seconds` and
    `steady_tokens_per_s` leave out the first SETTLE steps (NaN when no step is left).
    `runner`: one process, or this rank's part of a parallel run (te_core.demo.parallel); losses
    and tokens/s are then those of all ranks. `capture`: after the first (eager) step, the
    transformer layers are captured as device graphs (te_core.demo.capture) and replayed after it."""
    torch.manual_seed(cfg.seed)
    model = runner.build(cfg.model, device)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [dict(params=decay, weight_decay=cfg.weight_decay), dict(params=no_decay, weight_decay=0.0)]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    sampler = BatchSampler(train_tokens, cfg.model.batch_size, cfg.model.seq_len, seed=cfg.seed)
    result = RunResult(name)
    bar = ProgressBar(name, cfg.steps, enabled=progress)
    losses = []  # device scalars, read back only when the bar draws: a read waits for the device
    compiled = loss_of if compile_options is None else torch.compile(loss_of, **compile_options)
    # CUDA graphs (mode="reduce-overhead") overwrite a step's outputs on the next replay: each
    # step is marked, and the loss kept is a copy.
    graphs = (compile_options or {}).get("mode") == "reduce-overhead"
    recording = LayerCalls(model.layers) if capture else None
    synchronize()
    start = settled = time.perf_counter()
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        inputs, targets = runner.local_batch(*sampler.next(device))
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        # A compiled run's first step runs eagerly, so that delayed scaling's first casts take
        # their scales from their own tensors, which a graph cannot do (QuantizationStep.first_scale);
        # init_quantization_state then marks the state's tensors static for CUDA graphs.
        step_loss = loss_of if step == 0 else compiled
        if step == 1 and compile_options is not None and fp8_recipe is not None:
            init_quantization_state(model, fp8_recipe)
        loss = step_loss(model, inputs, targets, device, fp8_recipe)
        optimizer.zero_grad(set_to_none=True)
        runner.backward(loss)
        runner.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.detach().clone() if graphs else loss.detach())
        if recording is not None:
            # the step's autograd graph holds the parameters' gradient accumulators, made on the
            # default stream; the capture must make its own on the capturing stream
            loss = None
            capture_layers(model.layers, recording, fp8_recipe, device)
            recording = None
        if bar.due(step + 1):
            bar.update(step + 1, tokens_per_step=cfg.model.tokens_per_step, loss=float(losses[-1]))
        if step + 1 == SETTLE and cfg.steps > SETTLE:
            synchronize()
            settled = time.perf_counter()
    synchronize()
    end = time.perf_counter()
    result.seconds = runner.slowest(end - start)
    steady_steps = cfg.steps - SETTLE
    steady_seconds = runner.slowest(end - settled)  # on every rank: slowest is a collective
    if steady_steps > 0:
        result.steady_seconds = steady_seconds
        result.steady_tokens_per_s = cfg.model.tokens_per_step * steady_steps / max(steady_seconds, 1e-9)
    bar.close()
    result.losses = runner.mean_over_ranks(torch.stack(losses).float()).tolist()
    # tokens_per_step is the global batch's: the tokens/s of all ranks together
    result.tokens_per_s = cfg.model.tokens_per_step * cfg.steps / max(result.seconds, 1e-9)
    result.val_loss = evaluate(model, cfg, val_tokens, device, fp8_recipe, runner)
    return result


@torch.no_grad()
def evaluate(model: GPT, cfg: RunConfig, val_tokens, device: torch.device, fp8_recipe,
             runner: OneProcess = ONE_PROCESS) -> float:
    """Mean loss on cfg.eval_batches held-out batches (the same batches for every run)."""
    if cfg.eval_batches <= 0 or val_tokens.numel() <= cfg.model.seq_len + 1:
        return float("nan")
    sampler = BatchSampler(val_tokens, cfg.model.batch_size, cfg.model.seq_len, seed=cfg.seed + 1)
    losses = [loss_of(model, *runner.local_batch(*sampler.next(device)), device, fp8_recipe).float()
              for _ in range(cfg.eval_batches)]
    losses = runner.mean_over_ranks(torch.stack(losses)).tolist()
    return sum(losses) / len(losses)
