"""The casts with a pooled zero for their amax (te_backend_cuda.amax_slots) against the same
kernels zeroing a buffer of their own (te_triton called directly: the path before the pool),
and against maxing into an amax history slot. Three alternating rounds at 16384x8192 bf16
(GB/s, do_bench), then host time per call on a tiny tensor, then the scale_inv snapshot of a
two-column scaling group: one reciprocal into 16-byte slots against reciprocal + empty + copy.

    python benchmarks/probe_amax_slots.py
"""
import time

import torch
from triton.testing import do_bench
from te_triton import cast

from te_backend_cuda import configs, fused

E4M3 = torch.float8_e4m3fn
Q, CT = configs.QUANTIZE, configs.CAST_TRANSPOSE


def old_current(x, transpose):
    """Current scaling as before: zeroed amax, scale kernel, cast pass with a second zeroed amax."""
    amax_t = cast.amax(x, Q)
    scale, _ = cast.current_scale(amax_t, E4M3)
    return cast.cast_transpose_fp8(x, scale, E4M3, CT) if transpose else cast.quantize_fp8(x, scale, E4M3, Q)


def cases(x, s, slot):
    return {
        "quantize": {"own zero": lambda: cast.quantize_fp8(x, s, E4M3, Q),
                     "pooled": lambda: fused.quantize_fp8(x, s, E4M3),
                     "history slot": lambda: fused.quantize_fp8(x, s, E4M3, amax_out=slot)},
        "cast-transpose": {"own zero": lambda: cast.cast_transpose_fp8(x, s, E4M3, CT),
                           "pooled": lambda: fused.cast_transpose_fp8(x, s, E4M3),
                           "history slot": lambda: fused.cast_transpose_fp8(x, s, E4M3, amax_out=slot)},
        "current": {"own zero": lambda: old_current(x, False),
                    "pooled": lambda: fused.quantize_fp8_current(x, E4M3)},
        "current +T": {"own zero": lambda: old_current(x, True),
                       "pooled": lambda: fused.quantize_fp8_current(x, E4M3, with_transpose=True)},
    }


BYTES = {"quantize": 3, "cast-transpose": 4, "current": 5, "current +T": 6}  # per element: reads + writes


def check(x, s):
    want = x.abs().max().float()
    for name, fn in cases(x, s, torch.zeros(1, device="cuda"))["quantize"].items():
        got = fn()[1]
        assert torch.equal(got.reshape(()), want) or name == "history slot", name
    assert torch.equal(fused.quantize_fp8_current(x, E4M3)[4], want)
    assert torch.equal(fused.cast_transpose_fp8(x, s, E4M3)[2], want)


def bandwidth():
    M, N = 16384, 8192
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 3
    s = torch.tensor([40.0], device="cuda")
    check(x, s)
    table = {}
    for _ in range(3):
        for op, variants in cases(x, s, torch.zeros(1, device="cuda")).items():
            for name, fn in variants.items():
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                table.setdefault((op, name), []).append(BYTES[op] * M * N / ms / 1e6)
    print("\n16384x8192 bf16, GB/s, three alternating rounds")
    for (op, name), gbps in table.items():
        print(f"  {op:15s} {name:13s} " + " ".join(f"{g:6.0f}" for g in gbps) + f"   median {sorted(gbps)[1]:6.0f}")


def host_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def host():
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor([4.0], device="cuda")
    print("\nhost time per call (enqueue), 16x64 bf16, us")
    for _ in range(2):
        for op, variants in cases(x, s, torch.zeros(1, device="cuda")).items():
            print(f"  {op:15s} " + "  ".join(f"{name} {host_us(fn):6.1f}" for name, fn in variants.items()))


def snapshot():
    from te_core.quantization.scaling import ScalingGroup
    from te_core.recipe import DelayedScaling

    group = ScalingGroup(["input", "weight"], E4M3, DelayedScaling(), torch.device("cuda"))

    def old():  # session 12: reciprocal, then an aligned copy per column
        inv = torch.reciprocal(group.scale)
        slots = torch.empty(2, 4, dtype=torch.float32, device="cuda")
        slots[:, 0] = inv
        return [slot[:1] for slot in slots.unbind(0)]

    def new():
        group.scale_changed()
        return group.scale_inv_of(0), group.scale_inv_of(1)

    a, b = new()
    assert torch.equal(a, 1 / group.scale[:1]) and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    print("\nscale_inv snapshot of a 2-column group, host us per step: "
          + "  ".join(f"old {host_us(old):5.1f} new {host_us(new):5.1f}" for _ in range(2)))


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    host()
    snapshot()
    bandwidth()
