"""Module-level GPU benchmark: te.Linear and te.TransformerLayer in FP8 against bf16 torch and
torchao's Float8Linear, measured side by side in one process (PERFORMANCE.md's method).

Run on the GPU machine:  python benchmarks/bench_modules.py [--quick]
Writes benchmarks/results/modules-<date>.json (and $OUT/modules.json when $OUT is set) and
prints a table last. torchao is optional (its rows are skipped when it is not importable).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _timing import wall_us

import te_core as te
from te_core import recipe as te_recipe

DEV = "cuda"
LINEAR_SHAPES = [(16384, 8192, 8192), (16384, 8192, 28672), (8192, 4096, 4096)]
SKIP_TORCHAO = False
LAYER = dict(h=4096, ffn=16384, heads=32, s=2048, b=8)  # PERFORMANCE.md's layer
LAYER_REPS = (100, 400)  # do_bench warm-up / measuring time in ms: ~15 measured steps of the layer


def bench(fn, warmup=25, rep=200):
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def peak_mib(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def fwd_bwd(module, x, dy, ctx=None):
    def step():
        if ctx is None:
            y = module(x)
        else:
            with ctx():
                y = module(x)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(dy)

    return step


def torchao_linear(lin, recipe_name, compile_it=True):
    try:
        if SKIP_TORCHAO:
            raise RuntimeError("skipped (--skip-torchao)")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as exc:  # torchao is an optional peer
        return None, f"torchao unavailable: {exc}"
    model = nn.Sequential(lin)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe_name))
    return (torch.compile(model) if compile_it else model), ""


def linear_rows(quick):
    rows = []
    recipes = {"delayed": te_recipe.DelayedScaling, "current": te_recipe.Float8CurrentScaling,
               "block": te_recipe.Float8BlockScaling}
    for M, K, N in LINEAR_SHAPES[-1:] if quick else LINEAR_SHAPES:
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
        ref = nn.Linear(K, N, bias=False, device=DEV, dtype=torch.bfloat16)
        t_bf16 = bench(fwd_bwd(ref, x, dy))
        row = {"shape": f"M{M} K{K} N{N}", "bf16_ms": t_bf16}
        for name in ("tensorwise",):  # the peer the targets name; rowwise costs another compile
            lin = nn.Linear(K, N, bias=False, device=DEV, dtype=torch.bfloat16)
            model, why = torchao_linear(lin, name)
            row[f"torchao_{name}_ms"] = bench(fwd_bwd(model, x, dy)) if model is not None else None
        for name, make in recipes.items():
            lin = te.Linear(K, N, bias=False, params_dtype=torch.bfloat16)
            rcp = make()
            row[f"te_{name}_ms"] = bench(fwd_bwd(lin, x, dy, lambda: te.autocast(recipe=rcp)))
        row["te_delayed_graphed_ms"] = _graphed_ms(te.Linear(K, N, bias=False, params_dtype=torch.bfloat16), x, dy)
        rows.append(row)
        print(json.dumps(row), flush=True)  # partial results survive a timeout
    return rows


def _graphed_ms(module, x, dy, reps=(50, 200)):
    """fwd+bwd of `module` captured with te.make_graphed_callables (FP8 delayed scaling)."""
    rcp = te_recipe.DelayedScaling()
    try:
        graphed = te.make_graphed_callables(module, (x,), fp8_enabled=True, fp8_recipe=rcp)
        return bench(fwd_bwd(graphed, x, dy, lambda: te.autocast(recipe=rcp)), *reps)
    except Exception as exc:  # report, keep benchmarking the rest
        print(f"graphed {type(module).__name__} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return None


class TorchLayer(nn.Module):
    """A plain-PyTorch pre-LN GPT layer: the bf16 baseline (eager + SDPA)."""

    def __init__(self, h, ffn, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x):  # x: (s, b, h)
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, self.heads, h // self.heads).permute(2, 1, 3, 0, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def _row(rows, row):
    rows.append(row)
    print(json.dumps(row), flush=True)


def layer_rows(quick):
    h, ffn, heads, s, b = (LAYER[k] for k in ("h", "ffn", "heads", "s", "b"))
    b = 2 if quick else b
    x = torch.randn(s, b, h, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(s, b, h, device=DEV, dtype=torch.bfloat16)
    rows = []
    torch_layer = TorchLayer(h, ffn, heads).to(DEV, torch.bfloat16)
    step = fwd_bwd(torch_layer, x, dy)
    _row(rows, {"variant": "torch bf16 eager + SDPA", "ms": bench(step, *LAYER_REPS), "peak_mib": peak_mib(step)})
    try:
        if SKIP_TORCHAO:
            raise RuntimeError("skipped (--skip-torchao)")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        ao_layer = TorchLayer(h, ffn, heads).to(DEV, torch.bfloat16)
        convert_to_float8_training(ao_layer, config=Float8LinearConfig.from_recipe_name("tensorwise"))
        step = fwd_bwd(torch.compile(ao_layer), x, dy)
        _row(rows, {"variant": "torchao tensorwise + compile", "ms": bench(step, *LAYER_REPS), "peak_mib": peak_mib(step)})
    except Exception as exc:
        _row(rows, {"variant": "torchao tensorwise + compile", "ms": None, "peak_mib": None, "error": str(exc)[:200]})
    layer = te.TransformerLayer(h, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type="causal", params_dtype=torch.bfloat16)
    step = fwd_bwd(layer, x, dy)
    _row(rows, {"variant": "te bf16", "ms": bench(step, *LAYER_REPS), "peak_mib": peak_mib(step)})
    for name, rcp in (("delayed", te_recipe.DelayedScaling()), ("current", te_recipe.Float8CurrentScaling())):
        step = fwd_bwd(layer, x, dy, lambda rcp=rcp: te.autocast(recipe=rcp))
        _row(rows, {"variant": f"te fp8 {name}", "ms": bench(step, *LAYER_REPS), "peak_mib": peak_mib(step)})
    graphed_layer = te.TransformerLayer(h, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0,
                                        self_attn_mask_type="causal", params_dtype=torch.bfloat16)
    _row(rows, {"variant": "te fp8 delayed + make_graphed_callables",
                "ms": _graphed_ms(graphed_layer, x, dy, LAYER_REPS), "peak_mib": None})
    return rows


def tiny_rows():
    x = torch.randn(16, 64, device=DEV, dtype=torch.bfloat16)
    ref = nn.Linear(64, 64, device=DEV, dtype=torch.bfloat16)
    lin = te.Linear(64, 64, params_dtype=torch.bfloat16)
    rcp = te_recipe.DelayedScaling()

    def te_fwd():
        with torch.no_grad(), te.autocast(recipe=rcp):
            lin(x)

    with torch.no_grad():
        t_ref = wall_us(lambda: ref(x))
    row = {"nn.Linear bf16 us": t_ref, "te.Linear fp8 us": wall_us(te_fwd)}
    graphed = te.make_graphed_callables(te.Linear(64, 64, params_dtype=torch.bfloat16), (x,), fp8_enabled=True,
                                        fp8_recipe=rcp)

    def graphed_fwd():
        with torch.no_grad(), te.autocast(recipe=rcp):
            graphed(x)

    row["te.Linear fp8 graphed us"] = wall_us(graphed_fwd)
    print(json.dumps(row), flush=True)
    return [row]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-layer", action="store_true")
    parser.add_argument("--layer-only", action="store_true", help="the layer and tiny rows only")
    parser.add_argument("--skip-torchao", action="store_true")
    args = parser.parse_args()
    global SKIP_TORCHAO
    SKIP_TORCHAO = args.skip_torchao
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    result = {"meta": meta, "linear": [] if args.layer_only else linear_rows(args.quick), "tiny": tiny_rows()}
    if not args.skip_layer:
        result["layer"] = layer_rows(args.quick)
    path = os.path.join(os.path.dirname(__file__), "results", f"modules-{meta['date']}.json")
    for p in filter(None, [path, os.environ.get("OUT") and os.path.join(os.environ["OUT"], "modules.json")]):
        with open(p, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(meta))
    for row in result["linear"]:
        base = row["bf16_ms"]
        cells = "  ".join(f"{k[:-3]} {v:.2f}ms ({base / v:.2f}x)" for k, v in row.items() if k.endswith("_ms") and v)
        print(f"Linear {row['shape']}: {cells}")
    for row in result.get("layer", []):
        print(f"Layer {row['variant']:<30} {row['ms'] and round(row['ms'], 2)} ms  peak {row['peak_mib'] and round(row['peak_mib'])} MiB")
    print(f"tiny: {result['tiny'][0]}")


if __name__ == "__main__":
    main()
