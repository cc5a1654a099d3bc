"""What activation offloading (te.get_cpu_offload_context) costs and saves: a stack of
te.TransformerLayer trained with 0 .. k of its layers offloaded, step time (best of rounds) and
peak device memory above the step's inputs, in one process.

    python benchmarks/tools/offload_layers.py [--hidden 2048] [--layers 4] [--batch 4] [--max-offloaded 2]
"""
from __future__ import annotations

import argparse
import time

import torch

import te_core as te
from te_core import recipe


def measure(layers, x, offloaded: int, steps: int = 10):
    context, sync = te.get_cpu_offload_context(enabled=offloaded > 0, num_layers=offloaded, model_layers=len(layers))

    def step():
        h = x
        with te.autocast(recipe=recipe.DelayedScaling()):
            for layer in layers:
                with context:
                    h = layer(h)
                h = sync(h)
        h.float().sum().backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3, (torch.cuda.max_memory_allocated() - start) / 2**20


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--max-offloaded", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    h = args.hidden
    layers = torch.nn.ModuleList(
        te.TransformerLayer(h, 4 * h, h // 128, params_dtype=torch.bfloat16, device="cuda", self_attn_mask_type="causal",
                            hidden_dropout=0.0, attention_dropout=0.0) for _ in range(args.layers))
    x = torch.randn(args.seq, args.batch, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    results = {}
    for _ in range(args.rounds):  # alternating rounds: the host and the GPU's clocks drift alike for all
        for k in range(args.max_offloaded + 1):
            results.setdefault(k, []).append(measure(layers, x, k))
    for k, runs in results.items():
        print(f"offload {k} of {args.layers} layers (h{h} s{args.seq} b{args.batch}, delayed scaling): step "
              f"{min(ms for ms, _ in runs):.2f} ms, peak memory above the inputs {runs[-1][1]:.0f} MiB")


if __name__ == "__main__":
    main()
