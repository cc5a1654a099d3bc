"""Host cost of the pieces of a tiny FP8 te.Linear forward (input 16x64, weight 64x64): wall
microseconds per call of each layer, from a bare torch op and a bare Triton launch up to the
module under te.autocast, eager and captured with te.make_graphed_callables, then the top
Python functions (cProfile) of both module calls. Needs te-backend-cuda.

    python benchmarks/tools/host_overhead.py
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: shared helpers
from _timing import python_profile, wall_us  # noqa: E402

import te_core as te
from te_core import ops, recipe

DEV = "cuda"


@triton.jit
def _noop_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def main():
    torch.manual_seed(0)
    x = torch.randn(16, 64, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(64, 64, device=DEV, dtype=torch.bfloat16)
    ref = torch.nn.Linear(64, 64, device=DEV, dtype=torch.bfloat16)
    lin = te.Linear(64, 64, params_dtype=torch.bfloat16)
    rcp = recipe.DelayedScaling()
    scale = torch.ones(1, device=DEV)
    slot = torch.zeros(1, device=DEV)
    hist = [torch.zeros(1024, 2, device=DEV), torch.zeros(1024, 1, device=DEV)]
    scales = [torch.ones(2, device=DEV), torch.ones(1, device=DEV)]
    xq, _ = ops.quantize_fp8(x, scale, torch.float8_e4m3fn)
    wq, _ = ops.quantize_fp8(w, scale, torch.float8_e4m3fn)
    s_inv = torch.ones((), device=DEV)
    y = torch.empty_like(x)
    from te_core.quantization.float8_tensor import Float8Tensor
    from te_backend_cuda import ops as cuda_ops

    def te_fwd():
        with torch.no_grad(), te.autocast(recipe=rcp):
            lin(x)

    def autocast_only():
        with te.autocast(recipe=rcp):
            pass

    graphed = te.make_graphed_callables(te.Linear(64, 64, params_dtype=torch.bfloat16), (x,), fp8_enabled=True,
                                        fp8_recipe=rcp)

    def graphed_fwd():
        with torch.no_grad(), te.autocast(recipe=rcp):
            graphed(x)

    one_kernel = torch.cuda.CUDAGraph()
    update = torch.cuda.CUDAGraph()
    with torch.cuda.graph(one_kernel):
        y.mul_(1.0)
    ops.delayed_scaling_update(hist, scales, [448.0, 448.0])
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(update):
            ops.delayed_scaling_update(hist, scales, [448.0, 448.0])
    except RuntimeError as exc:
        print(f"capturing the update failed: {exc}")
        update = one_kernel

    rows = {
        "torch.empty": lambda: torch.empty(16, 64, device=DEV),
        "x * 2 (one torch kernel)": lambda: x * 2,
        "nn.Linear bf16 fwd (no grad)": lambda: ref(x),
        "bare Triton launch (3 args)": lambda: _noop_kernel[(1,)](x, y, x.numel(), BLOCK=1024),
        "te_backend_cuda quantize_fp8 (direct)": lambda: cuda_ops.quantize_fp8(x, scale, torch.float8_e4m3fn, amax_out=slot),
        "ops.quantize_fp8 (dispatch)": lambda: ops.quantize_fp8(x, scale, torch.float8_e4m3fn, amax_out=slot),
        "torch._scaled_mm (direct)": lambda: torch._scaled_mm(xq, wq.t(), s_inv, s_inv, out_dtype=torch.bfloat16),
        "ops.gemm_fp8 (dispatch)": lambda: ops.gemm_fp8(xq, wq, s_inv, s_inv, out_dtype=torch.bfloat16),
        "ops.delayed_scaling_update 2 groups": lambda: ops.delayed_scaling_update(hist, scales, [448.0, 448.0]),
        "Float8Tensor.make": lambda: Float8Tensor.make(xq, s_inv, None, nominal_dtype=torch.bfloat16),
        "te.autocast enter/exit (empty)": autocast_only,
        "te.Linear fp8 fwd under autocast": te_fwd,
        "graph replay (one kernel)": one_kernel.replay,
        "graph replay (delayed_scaling_update 2 groups)": update.replay,
        "graphed te.Linear fp8 fwd under autocast": graphed_fwd,
    }
    results = {}
    with torch.no_grad():
        for name, fn in rows.items():
            results[name] = wall_us(fn, 500, 30)
    python_profile(te_fwd, 300, 30)
    python_profile(graphed_fwd, 300, 25)
    print("host cost per call (wall us, 500 calls after warm-up):")
    for name, us in results.items():
        print(f"  {name:<42} {us:8.1f}")


if __name__ == "__main__":
    main()
