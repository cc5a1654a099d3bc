"""Host time per call of te_triton's descriptor kernels against the pointer kernel, and their
throughput timed eagerly (do_bench: host launches included) and as a CUDA graph replay
(do_bench_cudagraph: GPU only), at 16384x8192 bf16, for whichever te_triton is first on the
path. On a slow host the eager figures are host-bound; the graphed ones are the kernels'.

    python benchmarks/descriptor_host_cost.py
    PYTHONPATH=OLD/backends/triton python benchmarks/descriptor_host_cost.py   # another tree
"""
import time

import torch
import te_triton
from triton.testing import do_bench, do_bench_cudagraph
from te_triton import dbias, norm

from te_backend_cuda import configs

print("te_triton from", te_triton.__file__)
M, N = 16384, 8192
x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 3 + 1
w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
dy = torch.randn_like(x)
s = torch.tensor([16.0], device="cuda")
e4m3 = torch.float8_e4m3fn
_, mean, rstd, _ = norm.norm_fwd(x, w, b, 1e-5, rms=False)
cases = {  # name: (bytes per element, call)
 "LN fwd fp8 (3 B/elem)": (3, lambda: norm.norm_fwd(x, w, b, 1e-5, rms=False, fp8_scale=s, fp8_dtype=e4m3, cfg=configs.NORM_TMA[False, True])),
 "RMS fwd fp8": (3, lambda: norm.norm_fwd(x, w, None, 1e-5, rms=True, fp8_scale=s, fp8_dtype=e4m3, cfg=configs.NORM_TMA[True, True])),
 "LN bwd (6 B/elem)": (6, lambda: norm.norm_bwd(dy, x, mean, rstd, w, rms=False, cfg=configs.NORM_BWD_TMA_LONG_ROWS)),
 "dbias CT (4 B/elem)": (4, lambda: dbias.dbias_cast_transpose(dy, s, e4m3, configs.DBIAS_CAST_TRANSPOSE_TMA)),
 "LN fwd fp8 pointer": (3, lambda: norm.norm_fwd(x, w, b, 1e-5, rms=False, fp8_scale=s, fp8_dtype=e4m3, cfg=configs.NORM_LAYERNORM_LONG_ROWS)),
}
for name, (bpe, fn) in cases.items():
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        fn()
    host_ms = (time.perf_counter() - t0) / 50 * 1e3  # no sync inside: enqueue time, the GPU trails
    torch.cuda.synchronize()
    eager = do_bench(fn, warmup=10, rep=100)
    graph = do_bench_cudagraph(fn, rep=100)
    print(f"{name:26s} host {host_ms * 1e3:6.1f} us/call  eager {bpe*M*N/eager/1e6:6.0f} GB/s  graphed {bpe*M*N/graph/1e6:6.0f} GB/s", flush=True)
