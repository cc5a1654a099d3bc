"""Module benchmark on a GPU: te.Linear and te.TransformerLayer in FP8 against bf16 torch and
torchao's Float8Linear, side by side in one process, fwd+bwd timed with triton's do_bench.

Rows: te.Linear over bf16 nn.Linear at three GEMM shapes (delayed, current and block scaling
eager, delayed captured with te.make_graphed_callables, torchao tensorwise + torch.compile);
the TransformerLayer h4096 ffn16384 32 heads s2048 b8 (time and peak memory: plain-torch bf16,
torchao, te bf16, te FP8); the tiny FP8 forward (te.Linear(64, 64), 16 tokens, wall time).
torchao is optional: without it its rows record why.

    python benchmarks/bench_modules.py [--quick] [--skip-layer] [--layer-only] [--skip-torchao] [--results DIR]

Writes RESULTS/<gpu>/modules.json (see _results.py) and prints a summary last;
`python benchmarks/report.py` turns it into the targets table of docs/performance.md.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from _results import add_results_argument, meta, write_json
from _timing import median_ms, peak_mib, wall_us

import te_core as te
from te_core import recipe as te_recipe

DEV = "cuda"
LINEAR_SHAPES = [(16384, 8192, 8192), (16384, 8192, 28672), (8192, 4096, 4096)]
SKIP_TORCHAO = False
LAYER = dict(h=4096, ffn=16384, heads=32, s=2048, b=8)
LAYER_REPS = (100, 400)  # do_bench warm-up / measuring time in ms: ~15 measured steps of the layer


def bench(fn, warmup=25, rep=200):
    return median_ms(fn, DEV, warmup, rep)


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


def torchao_float8(module, recipe_name="tensorwise"):
    """`module` with its nn.Linear layers swapped for torchao's Float8Linear (in place). torchao
    is an optional peer: raises RuntimeError saying why when it cannot be used."""
    if SKIP_TORCHAO:
        raise RuntimeError("skipped (--skip-torchao)")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise RuntimeError(f"torchao not importable ({exc}); install its wheel to measure it") from exc
    convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe_name))
    return module


def te_layer(h, ffn, heads, device=DEV):
    """te.TransformerLayer as the benchmarks run it: bf16 parameters, causal, no dropout."""
    return te.TransformerLayer(h, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0,
                               self_attn_mask_type="causal", params_dtype=torch.bfloat16, device=device)


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
        try:  # tensorwise: the peer the targets name (rowwise costs another compile)
            model = torchao_float8(nn.Sequential(nn.Linear(K, N, bias=False, device=DEV, dtype=torch.bfloat16)))
            row["torchao_tensorwise_ms"] = bench(fwd_bwd(torch.compile(model), x, dy))
        except RuntimeError as exc:
            row["torchao_tensorwise_ms"] = None
            print(f"torchao row skipped: {exc}", flush=True)
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
    _row(rows, {"variant": "torch bf16 eager + SDPA", "ms": bench(step, *LAYER_REPS), "peak_mib": peak_mib(step, DEV)})
    try:
        ao_layer = torchao_float8(TorchLayer(h, ffn, heads).to(DEV, torch.bfloat16))
        step = fwd_bwd(torch.compile(ao_layer), x, dy)
        _row(rows, {"variant": "torchao tensorwise + compile", "ms": bench(step, *LAYER_REPS), "peak_mib": peak_mib(step, DEV)})
    except Exception as exc:  # report, keep benchmarking the rest
        _row(rows, {"variant": "torchao tensorwise + compile", "ms": None, "peak_mib": None, "error": str(exc)[:200]})
    layer = te_layer(h, ffn, heads)
    step = fwd_bwd(layer, x, dy)
    _row(rows, {"variant": "te bf16", "ms": bench(step, *LAYER_REPS), "peak_mib": peak_mib(step, DEV)})
    for name, rcp in (("delayed", te_recipe.DelayedScaling()), ("current", te_recipe.Float8CurrentScaling())):
        step = fwd_bwd(layer, x, dy, lambda rcp=rcp: te.autocast(recipe=rcp))
        _row(rows, {"variant": f"te fp8 {name}", "ms": bench(step, *LAYER_REPS), "peak_mib": peak_mib(step, DEV)})
    _row(rows, {"variant": "te fp8 delayed + make_graphed_callables",
                "ms": _graphed_ms(te_layer(h, ffn, heads), x, dy, LAYER_REPS), "peak_mib": None})
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
    add_results_argument(parser)
    args = parser.parse_args()
    global SKIP_TORCHAO
    SKIP_TORCHAO = args.skip_torchao
    result = {"meta": meta(DEV), "linear": [] if args.layer_only else linear_rows(args.quick), "tiny": tiny_rows()}
    if not args.skip_layer:
        result["layer"] = layer_rows(args.quick)
    print(f"wrote {write_json('modules', result, args.results)}")
    print(json.dumps(result["meta"]))
    for row in result["linear"]:
        base = row["bf16_ms"]
        cells = "  ".join(f"{k[:-3]} {v:.2f}ms ({base / v:.2f}x)" for k, v in row.items() if k.endswith("_ms") and v)
        print(f"Linear {row['shape']}: {cells}")
    for row in result.get("layer", []):
        print(f"Layer {row['variant']:<30} {row['ms'] and round(row['ms'], 2)} ms  peak {row['peak_mib'] and round(row['peak_mib'])} MiB")
    print(f"tiny: {result['tiny'][0]}")


if __name__ == "__main__":
    main()
