"""benchmarks/tools/profile_layer.py: kernels sorted into families by name, and the bounds on FP8's
ratio over bf16 computed from the family sums."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "tools"))
import profile_layer  # noqa: E402

# kernel names as torch.profiler reports them for the layer step on an H100 (cuBLASLt, cuDNN,
# te_triton and torch kernels)
NAMES = {
    "nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT": "GEMM",
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT": "GEMM",
    "_gemm_kernel": "GEMM",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1x1_kernel0_0":
        "attention",
    "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*, void const*, void*)": "attention",
    "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3ul> >(int)": "element-wise add",
    "_cast_transpose_kernel": "FP8 casts",
    "_dbias_ct_tma_kernel": "FP8 casts",
    "_transpose_kernel": "FP8 casts",
    "_quantize_kernel": "FP8 casts",
    "_delayed_update_tile_kernel": "FP8 casts",
    "_norm_bwd_kernel": "norms",
    "_act_fwd_kernel": "activations",
    "Memset (Device)": "other",
    "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float>>()": "other",
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_each_kernel_lands_in_its_family(name):
    assert profile_layer.kernel_family(name) == NAMES[name]


def test_family_sums_keep_every_microsecond_and_the_order():
    kernels = {name: float(i + 1) for i, name in enumerate(sorted(NAMES))}
    sums = profile_layer.by_family(kernels)
    assert list(sums) == [f for f, _ in profile_layer.FAMILIES] + ["other"]
    assert sum(sums.values()) == pytest.approx(sum(kernels.values()))
    for family in sums:
        assert sums[family] == pytest.approx(sum(t for n, t in kernels.items() if NAMES[n] == family))


def test_bounds_from_family_sums():
    bf16 = {"GEMM": 12.0, "attention": 1.0, "other": 3.0}
    fp8 = {"GEMM": 6.0, "attention": 1.0, "other": 3.5}
    sums, gemms, free = profile_layer.bounds(bf16, fp8)
    assert sums == pytest.approx(16.0 / 10.5)
    assert gemms == pytest.approx(2.0)
    assert free == pytest.approx(16.0 / (6.0 + 4.0))  # FP8's GEMMs plus bf16's attention and rest
    with pytest.raises(ValueError, match="no GEMM time"):
        profile_layer.bounds(bf16, {"GEMM": 0.0, "other": 1.0})


def test_bad_arguments_say_what_to_pass(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["profile_layer.py", "--recipes", "bf16,fp4"])
    with pytest.raises(SystemExit):
        profile_layer.main()
    assert "--recipes: unknown ['fp4']; choose from delayed, current, block, bf16" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["profile_layer.py", "--recipes", "bf16"])
    monkeypatch.setattr(profile_layer.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        profile_layer.main()
    assert "profiles CUDA kernels: run it on a machine with an NVIDIA GPU" in capsys.readouterr().err


def test_unknown_mode_says_what_to_pass(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["profile_layer.py", "--recipes", "bf16", "--modes", "eager,graphed"])
    with pytest.raises(SystemExit):
        profile_layer.main()
    assert "--modes: unknown ['graphed']; choose from eager, compiled" in capsys.readouterr().err


def test_compiled_against_eager_by_family():
    gemm, cast, add = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", "_cast_transpose_kernel", \
        "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, " \
        "std::array<char*, 3ul> >(int)"
    eager = ({gemm: 6000.0, cast: 1000.0}, {gemm: 6.0, cast: 10.0})
    compiled = ({gemm: 6000.0, cast: 900.0, add: 300.0}, {gemm: 6.0, cast: 8.0, add: 3.0})
    lines = profile_layer.compared(eager, compiled)
    assert lines[0] == "  compiled over eager: GPU time 1.029x, 17 against 16 kernels"
    assert "  FP8 casts           1.000 ->   0.900 ms,    10 ->     8 kernels" in lines
    assert "  element-wise add    0.000 ->   0.300 ms,     0 ->     3 kernels" in lines
    assert not any(line.lstrip().startswith(("attention", "norms")) for line in lines)


def test_report_counts_kernels_per_family():
    lines = profile_layer.report("delayed", {"_gemm_kernel": 2000.0, "_quantize_kernel": 500.0}, rows=5,
                                 counts={"_gemm_kernel": 3.0, "_quantize_kernel": 4.0})
    assert lines[0] == "GPU time per step 2.50 ms, 7 kernels; by family:"
    assert "    2.000 ms  80.0%      3 kernels  GEMM" in lines
    assert "    0.500 ms  20.0%      4 kernels  FP8 casts" in lines
