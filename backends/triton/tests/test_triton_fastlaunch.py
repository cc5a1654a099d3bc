"""te_triton._fastlaunch, the C half of repeated launches: its key tells apart what Triton
specializes on and nothing else, and a plan passes each parameter as Triton's launcher does.

These run where the extension was built (any C compiler); the launch itself needs a GPU and is
covered by the GPU suites, which launch every te_triton kernel through it."""
import struct
from types import SimpleNamespace

import pytest
import torch

from te_triton import launch

fastlaunch = pytest.importorskip("te_triton._fastlaunch", reason="te_triton's C extension was not built here")
fastlaunch.bind(torch.Tensor, float)

MASK = b"...c"  # three arguments, then a constexpr


def key(*args, device=0, options=()):
    return fastlaunch.key(MASK, device, options, args)


def triton_view(value):
    """What Triton specializes a non-constexpr argument on (NVIDIA targets)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.data_ptr() % 16 == 0)
    if value is None or isinstance(value, bool):
        return ("value", value)
    if isinstance(value, int):
        return ("int", value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value >= 2**63)
    if isinstance(value, float):
        return ("float",)
    raise TypeError(value)


def test_key_tells_apart_exactly_what_triton_specializes_on():
    base = torch.randn(64)
    values = [base, base[1:], base[3:], base[4:], base.to(torch.bfloat16), torch.randn(64), base[8:], 1, 2, 16, 32, 17, -16, -3,
              2**31, 2**31 - 1, 2**63, 2**64 - 1, 0.5, 2.0, None, True, False]
    for a in values:
        for b in values:
            same = triton_view(a) == triton_view(b)
            assert (key(a, 7, 1.0, 64) == key(b, 7, 1.0, 64)) is same, (a, b)


def test_key_holds_constexprs_options_and_device_by_value():
    x = torch.randn(8)
    assert key(x, 1, 2.0, 64) != key(x, 1, 2.0, 128)
    assert key(x, 1, 2.0, 64) == key(x, 1, 2.0, 64)
    assert key(x, 1, 2.0, 64, options=(("num_warps", 4),)) != key(x, 1, 2.0, 64, options=(("num_warps", 8),))
    assert key(x, 1, 2.0, 64, device=0) != key(x, 1, 2.0, 64, device=1)


def test_an_argument_without_a_rule_has_no_key():
    """An argument the key cannot describe (a string, an int beyond 64 bits below zero) sends the
    launch to Python's path instead of guessing."""
    assert key("text", 1, 2.0, 64) is None
    assert key(torch.randn(4), -(2**70), 2.0, 64) is None
    with pytest.raises(TypeError):
        fastlaunch.key(MASK, 0, (), [1, 2, 3, 4])  # not a tuple


def compiled(signature, **metadata):
    md = dict(num_warps=4, num_ctas=1, shared=1024, global_scratch_size=0, profile_scratch_size=0,
              launch_cooperative_grid=False, launch_pdl=False)
    md.update(metadata)
    return SimpleNamespace(metadata=SimpleNamespace(**md), src=SimpleNamespace(signature=signature), function=0xBEEF)


SIGNATURE = {"x_ptr": "*bf16", "n": "i32", "big": "i64", "scale": "fp32", "flag": "i1", "wide": "u64",
             "BLOCK": "constexpr", "eps": "fp64"}


@pytest.fixture
def plan_available(monkeypatch):
    monkeypatch.setattr(launch, "C_LAUNCH", fastlaunch)


def test_a_plan_passes_each_parameter_as_tritons_launcher(plan_available):
    x = torch.randn(4)
    args = (x, 1000, -(2**40), 0.1, True, 2**64 - 5, 128, 1e-300)
    plan = launch.make_plan(compiled(SIGNATURE), args)
    ptrs = [0x7F00_0000_1230, 0, 0, 0, 0, 0, 0, 0]
    got = fastlaunch.pack_for_test(plan, args, ptrs)
    want = (struct.pack("<Q", 0x7F00_0000_1230), struct.pack("<i", 1000), struct.pack("<q", -(2**40)),
            struct.pack("<f", 0.1), struct.pack("<b", 1), struct.pack("<Q", 2**64 - 5), struct.pack("<d", 1e-300),
            struct.pack("<Q", 0), struct.pack("<Q", 0))  # the constexpr left out; two null scratch pointers
    assert got == want


@pytest.mark.parametrize("change", [
    dict(num_ctas=2), dict(global_scratch_size=64), dict(profile_scratch_size=8), dict(launch_cooperative_grid=True),
    dict(launch_pdl=True)])
def test_no_plan_for_launches_the_driver_call_does_not_repeat(plan_available, change):
    args = (torch.randn(4), 1, 1, 0.5, True, 1, 128, 1.0)
    assert launch.make_plan(compiled(SIGNATURE, **change), args) is None


def test_no_plan_for_parameters_it_does_not_pass(plan_available):
    args = (torch.randn(4), 3)
    assert launch.make_plan(compiled({"d": "tensordesc<bf16[64, 64]>", "n": "i32"}), args) is None
    assert launch.make_plan(compiled({"x": "*fp32", "h": "fp16"}), (torch.randn(4), 0.5)) is None
    assert launch.make_plan(compiled({"x": "*fp32", "n": "i32"}), (0x1000, 3)) is None  # a pointer as an int
    assert launch.make_plan(compiled({"x": "*fp32"}), (torch.randn(4), 3)) is None  # another call's arguments


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="unknown parameter kind"):
        fastlaunch.make_plan(1, 4, 0, b"pz", 2)
    with pytest.raises(ValueError, match="at most 64 parameters"):
        fastlaunch.make_plan(1, 4, 0, b"p" * 65, 2)


def test_the_c_switch_names_its_variable():
    assert launch.switched_on("0", "TE_TRITON_C_LAUNCH") is False
    with pytest.raises(ValueError, match="TE_TRITON_C_LAUNCH='maybe'.*C extension"):
        launch.switched_on("maybe", "TE_TRITON_C_LAUNCH")


# --- the generated launch's use of the C half (stand-in kernel and driver, a recording C launch) ----

from test_triton_launch import STREAM, _Kernel  # noqa: E402


@pytest.fixture
def c_kernel(monkeypatch):
    """A stand-in kernel whose launches go through a recording twin of the C launch: it looks the
    call up under the extension's own key, as the C code does, and reports instead of launching."""
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(launch, "C_LAUNCH", fastlaunch)
    monkeypatch.setattr(launch, "_DRIVER", [(lambda: 0, lambda device: STREAM, True)])
    monkeypatch.setattr(launch, "make_plan", lambda compiled, args: ("plan", len(args)))
    calls = []
    monkeypatch.setattr(launch, "_C_STATE", [c_kernel_launch(calls)])
    raw = _Kernel()
    return raw, launch.launcher(raw), calls


def c_kernel_launch(calls):
    """The recording twin of the C launch (see c_kernel)."""
    def c_launch(plans, mask, device, options, grid, stream, args):
        found = plans.get(fastlaunch.key(mask, device, options, args))
        calls.append((grid, stream, args, found is not None))
        return None if found is None else found[1]
    return c_launch


def test_a_repeated_launch_goes_to_c_under_the_key_registered_at_the_first(c_kernel):
    raw, k, calls = c_kernel
    first = k[(3,)](torch.randn(64), torch.empty(64), 64, 0.5, BLOCK=128, num_warps=4)
    x, y = torch.randn(32), torch.empty(32)
    again = k[(5, 2)](x, y, 32, 2.0, BLOCK=128, num_warps=4)
    assert [e[0] for e in raw.log] == ["triton"]  # the second launch never reached Python's path
    assert again is first  # the compiled kernel registered with the plan
    assert calls[-1] == ((5, 2), STREAM, (x, y, 32, 2.0, 128, True), True)


def test_what_the_c_key_misses_takes_pythons_path(c_kernel):
    raw, k, calls = c_kernel
    x = torch.randn(65)
    k[(1,)](x[:64], torch.empty(64), 64, 0.5, BLOCK=128)
    k[(1,)](x[1:], torch.empty(64), 64, 0.5, BLOCK=128)  # misaligned: another specialization
    assert [e[0] for e in raw.log] == ["triton", "triton"]
    assert [hit for *_, hit in calls] == [False, False]


def test_hooks_callable_grids_and_the_switch_keep_launches_in_python(c_kernel, monkeypatch):
    raw, k, calls = c_kernel
    args = (torch.randn(16), torch.empty(16), 16, 1.0)
    k[(1,)](*args, BLOCK=16)
    k[lambda meta: (2,)](*args, BLOCK=16)  # a callable grid
    previous = launch.use_c_launch(False)
    k[(1,)](*args, BLOCK=16)
    launch.use_c_launch(previous)
    monkeypatch.setattr(launch._knobs.runtime, "launch_enter_hook", lambda metadata: None)
    k[(1,)](*args, BLOCK=16)
    assert [e[0] for e in raw.log if e[0] != "metadata"] == ["triton", "direct", "direct", "direct"]
    assert len(calls) == 1  # only the first launch asked the C half (and found nothing yet)


def test_a_specialization_first_launched_while_off_goes_to_c_once_on(c_kernel):
    raw, k, calls = c_kernel
    args = (torch.randn(16), torch.empty(16), 16, 1.0)
    recording = launch._C_STATE[0]
    assert launch.use_c_launch(False) is True and launch._C_STATE[0] is None
    k[(1,)](*args, BLOCK=16)  # Triton's first launch, with the C launch off: the plan is registered all the same
    assert calls == []
    launch._C_STATE[0] = recording  # on again (use_c_launch(True) would bind the real extension)
    k[(1,)](*args, BLOCK=16)
    assert [e[0] for e in raw.log] == ["triton"] and calls[-1][-1] is True


def test_the_status_line_says_where_launches_go_and_why(monkeypatch):
    monkeypatch.setattr(launch, "C_LAUNCH", fastlaunch)
    monkeypatch.setattr(launch, "_C_STATE", [fastlaunch.launch])
    assert "go from C to the driver" in launch.c_launch_status()
    monkeypatch.setattr(launch, "_C_STATE", [None])
    monkeypatch.setattr(launch, "_C_REASON", "")
    assert launch.c_launch_status().endswith("turned off in this process (use_c_launch(False))")
    monkeypatch.setenv("TE_TRITON_C_LAUNCH", "0")
    assert launch._c_launcher() == (None, "TE_TRITON_C_LAUNCH=0")
    monkeypatch.setenv("TE_TRITON_C_LAUNCH", "1")
    monkeypatch.setattr(launch, "ENABLED", False)
    assert "launch cache is off" in launch._c_launcher()[1]
