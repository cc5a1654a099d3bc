"""All-gather bytes per training step of a model sharded with FSDP2 (fully_shard): BF16 weights
against FP8 primary weights (te.quantized_model_init, FP8 all-gather), and the step time.

    torchrun --nproc-per-node 2 benchmarks/tools/fsdp_all_gather_bytes.py [--hidden 1024] [--layers 2]

Runs on the GPUs with NCCL when there are any (one process per GPU), else on CPU with gloo.
Each model is a stack of LayerNormMLP layers (ffn = 4 x hidden), each layer its own FSDP2
unit, bf16 parameters; one step is a forward and a backward under te.autocast with the recipe,
and an SGD step. Rank 0 prints one line per model: the bytes each rank sends in the step's
all-gathers (te_core.distributed.comm_bytes.AllGatherBytes), the bytes it receives, their ratio
to the BF16 model's, and the median step time (timed without the byte counter).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import te_core as te
from te_core.distributed.comm_bytes import AllGatherBytes
from te_core.modules import LayerNormMLP
from te_core.recipe import DelayedScaling, Float8CurrentScaling

RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling}


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _model(args, device, fp8_weights: bool, recipe):
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=fp8_weights, recipe=recipe):
        model = torch.nn.Sequential(*[LayerNormMLP(args.hidden, 4 * args.hidden, params_dtype=torch.bfloat16,
                                                   device=device) for _ in range(args.layers)])
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _step(model, optimizer, x, recipe) -> None:
    with te.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
        y = model(x)
    y.float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(args, device, fp8_weights: bool, recipe) -> dict:
    model = _model(args, device, fp8_weights, recipe)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16)
    _step(model, optimizer, x, recipe)  # warm-up: the first all-gather binds each FP8 shard's scale
    with AllGatherBytes() as counted:
        _step(model, optimizer, x, recipe)
    times = []
    for _ in range(args.steps):
        _sync(device)
        start = time.perf_counter()
        _step(model, optimizer, x, recipe)
        _sync(device)
        times.append(time.perf_counter() - start)
    return {"sent": counted.sent, "calls": counted.calls, "ms": 1e3 * statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="rows of each rank's input")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--recipes", default="delayed,current", help=f"of {sorted(RECIPES)}")
    args = parser.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device, world = _device(), dist.get_world_size()
    results = {}
    for name in args.recipes.split(","):
        recipe = RECIPES[name]()
        results.setdefault("bf16 weights", measure(args, device, False, recipe))
        results[f"fp8 weights ({name})"] = measure(args, device, True, recipe)
    if dist.get_rank() == 0:
        base = results["bf16 weights"]["sent"]
        print(f"FSDP2 over {world} ranks ({dist.get_backend()}, {device.type}): {args.layers} x LayerNormMLP "
              f"h{args.hidden} ffn{4 * args.hidden}, {args.tokens} tokens per rank, compute under te.autocast")
        print(f"{'parameters':<24}{'sent/rank/step':>16}{'received':>14}{'vs bf16':>9}{'all-gathers':>13}{'ms/step':>9}")
        for label, r in results.items():
            print(f"{label:<24}{r['sent']:>16,}{r['sent'] * world:>14,}{r['sent'] / base:>9.1%}"
                  f"{r['calls']:>13}{r['ms']:>9.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
