"""te_triton.launch: which launches reuse a compiled kernel and what they pass it.

A stand-in kernel records Triton's own launches (kernel[grid](...)) and the direct ones
(compiled.run(...)); the key must send every change Triton specializes on back to Triton."""
import inspect
from types import SimpleNamespace

import pytest
import torch

from te_triton import launch

pytestmark = pytest.mark.skipif(launch._knobs is None, reason="this triton has no knobs module (before 3.4)")

STREAM = 1234


class _Compiled:
    packed_metadata, function = "meta", "fn"

    def __init__(self, log):
        self.log = log

    def launch_metadata(self, grid, stream, *values):
        self.log.append(("metadata", grid, stream))
        return "launch-metadata"

    def run(self, *args):
        self.log.append(("direct", args))


class _Kernel:
    """Parameters (x, y, n, scale, BLOCK: constexpr, FLAG: constexpr = True) like a @triton.jit kernel's."""

    def __init__(self):
        self.log = []
        self.pre_run_hooks = []
        self.params = [SimpleNamespace(name=n, is_constexpr=c, default=d) for n, c, d in (
            ("x", False, inspect.Parameter.empty), ("y", False, inspect.Parameter.empty),
            ("n", False, inspect.Parameter.empty), ("scale", False, inspect.Parameter.empty),
            ("BLOCK", True, inspect.Parameter.empty), ("FLAG", True, True))]

    def __getitem__(self, grid):
        def triton_launch(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return _Compiled(self.log)
        return triton_launch


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(launch, "_DRIVER", [(lambda: 0, lambda device: STREAM, True)])
    raw = _Kernel()
    return raw, launch.launcher(raw)


def _kinds(raw):
    return [entry[0] for entry in raw.log if entry[0] != "metadata"]


def test_second_launch_of_a_specialization_goes_direct_with_bound_arguments(kernel):
    raw, k = kernel
    x, y = torch.randn(64), torch.empty(64)
    k[(3,)](x, y, 64, 0.5, BLOCK=128, num_warps=4)
    x2, y2 = torch.randn(32), torch.empty(32)
    k[(5, 2)](x2, y2, 32, 2.0, BLOCK=128, num_warps=4)  # other tensors and values, same specialization
    assert [k for k in _kinds(raw) if k != "metadata"] == ["triton", "direct"]
    # grid padded to 3-D, the stream, the compiled function and metadata, then (no hook is set)
    # no launch metadata and no hooks, then every parameter in order with its default filled in
    direct = [entry for entry in raw.log if entry[0] == "direct"]
    assert direct[0][1][:6] == (5, 2, 1, STREAM, "fn", "meta")
    assert direct[0][1][6:9] == (None, None, None)
    assert ("metadata", (5, 2), STREAM) not in raw.log
    assert direct[0][1][9:] == (x2, y2, 32, 2.0, 128, True)


@pytest.mark.skipif(launch._knobs is None or not hasattr(launch._knobs.runtime.launch_enter_hook, "calls"),
                    reason="triton before hook chains")
def test_a_hook_chain_is_passed_only_when_it_holds_a_hook(kernel, monkeypatch):
    """Recent Triton's hook knobs are chains, never None: an empty chain is passed as None
    (nothing to call, no launch metadata to make), one holding a hook as it is."""
    raw, k = kernel
    chain = type(launch._knobs.runtime.launch_enter_hook)()
    monkeypatch.setattr(launch._knobs.runtime, "launch_enter_hook", chain)
    for _ in range(2):
        k[(1,)](torch.randn(4), torch.empty(4), 4, 1.0, BLOCK=16)
    seen = []
    chain.add(seen.append)
    k[(1,)](torch.randn(4), torch.empty(4), 4, 1.0, BLOCK=16)
    direct = [entry for entry in raw.log if entry[0] == "direct"]
    assert [entry[1][6:8] for entry in direct] == [(None, None), ("launch-metadata", chain)]


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int_divisible", "int_one", "int64", "constexpr",
                                    "default_constexpr", "option", "device"])
def test_what_triton_specializes_on_goes_back_to_triton(kernel, monkeypatch, change):
    raw, k = kernel
    x, y = torch.randn(65), torch.empty(64)
    args = dict(x=x[:64], y=y, n=64, scale=0.5)
    kwargs = dict(BLOCK=128, num_warps=4)
    k[(1,)](*args.values(), **kwargs)
    if change == "misaligned":
        args["x"] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args["x"] = x[:64].double()
    elif change == "int_divisible":
        args["n"] = 63
    elif change == "int_one":
        args["n"] = 1
    elif change == "int64":
        args["n"] = 2**40
    elif change == "constexpr":
        kwargs["BLOCK"] = 256
    elif change == "default_constexpr":
        kwargs["FLAG"] = False
    elif change == "option":
        kwargs["num_warps"] = 8
    else:
        monkeypatch.setattr(launch, "_DRIVER", [(lambda: 1, lambda device: STREAM, True)])
    k[(1,)](*args.values(), **kwargs)
    assert _kinds(raw) == ["triton", "triton"]
    k[(1,)](*args.values(), **kwargs)  # and that specialization is remembered in turn
    assert _kinds(raw) == ["triton", "triton", "direct"]


def test_parameters_none_and_bools_key_like_tensors_and_values(kernel):
    """A tensor subclass (a Parameter) keys by dtype and alignment like a tensor; None and a
    bool by themselves: a second call goes direct, a misaligned Parameter goes back to Triton."""
    raw, k = kernel
    weight = torch.nn.Parameter(torch.randn(65))
    k[(1,)](weight[:64].detach(), None, 64, 1.0, BLOCK=16)
    k[(1,)](torch.nn.Parameter(torch.randn(64)), None, 64, 1.0, BLOCK=16)
    assert _kinds(raw) == ["triton", "direct"]
    k[(1,)](torch.nn.Parameter(torch.randn(64)), True, 64, 1.0, BLOCK=16)  # a bool where None was
    k[(1,)](weight[1:].detach(), None, 64, 1.0, BLOCK=16)  # misaligned
    assert _kinds(raw) == ["triton", "direct", "triton", "triton"]


def test_argument_without_a_rule_always_takes_triton_path(kernel):
    raw, k = kernel
    for _ in range(3):
        k[(1,)](torch.randn(4), torch.empty(4), 4, object(), BLOCK=16)
    assert _kinds(raw) == ["triton"] * 3


def test_callable_grid_gets_the_bound_arguments(kernel):
    raw, k = kernel
    seen = []

    def grid(meta):
        seen.append(meta)
        return (meta["n"] // meta["BLOCK"],)

    k[grid](torch.randn(64), torch.empty(64), 64, 1.0, BLOCK=16)
    k[grid](torch.randn(64), torch.empty(64), 64, 1.0, BLOCK=16)
    assert [entry for entry in raw.log if entry[0] == "direct"][0][1][:3] == (4, 1, 1)
    assert seen[-1]["FLAG"] is True and seen[-1]["n"] == 64


def test_disabled_or_hooked_kernels_take_triton_path(kernel, monkeypatch):
    raw, k = kernel
    raw.pre_run_hooks.append(lambda *a, **kw: None)
    for _ in range(2):
        k[(1,)](torch.randn(4), torch.empty(4), 4, 1.0, BLOCK=16)
    monkeypatch.setattr(launch, "ENABLED", False)
    off = launch.launcher(_Kernel())
    for _ in range(2):
        off[(1,)](torch.randn(4), torch.empty(4), 4, 1.0, BLOCK=16)
    assert _kinds(raw) == ["triton", "triton"] and _kinds(off.kernel) == ["triton", "triton"]


def test_the_kernels_own_attributes_show_through(kernel):
    raw, k = kernel
    assert k.params is raw.params and k.kernel is raw


@pytest.mark.parametrize("value,on", [(None, True), ("", True), ("1", True), ("ON", True), (" yes ", True),
                                      ("0", False), ("false", False), ("Off", False)])
def test_switch_values(value, on):
    assert launch.switched_on(value) is on


def test_unknown_switch_value_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match="TE_TRITON_FAST_LAUNCH='maybe'.*set it to 1"):
        launch.switched_on("maybe")


def test_a_launch_hook_gets_the_kernels_launch_metadata(kernel, monkeypatch):
    """With an enter hook set (a profiler's), the direct launch passes what launch_metadata
    returns, as Triton's own launch does."""
    raw, k = kernel
    hook = lambda metadata: None  # noqa: E731
    monkeypatch.setattr(launch._knobs.runtime, "launch_enter_hook", hook)
    for _ in range(2):
        k[(1,)](torch.randn(4), torch.empty(4), 4, 1.0, BLOCK=16)
    direct = [entry for entry in raw.log if entry[0] == "direct"]
    assert len(direct) == 1 and direct[0][1][6:8] == ("launch-metadata", hook)
    assert ("metadata", (1,), STREAM) in raw.log


def test_a_target_other_than_nvidias_keeps_tritons_path(kernel, monkeypatch):
    raw, k = kernel
    monkeypatch.setattr(launch, "_DRIVER", [(lambda: 0, lambda device: STREAM, False)])
    for _ in range(3):
        k[(1,)](torch.randn(4), torch.empty(4), 4, 1.0, BLOCK=16)
    assert _kinds(raw) == ["triton"] * 3


def test_a_missing_argument_is_named_and_nothing_launches(kernel):
    raw, k = kernel
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'scale'"):
        k[(1,)](torch.randn(4), torch.empty(4), 4, BLOCK=16)
    assert _kinds(raw) == []


@pytest.mark.parametrize("call", ["too_many", "twice"])
def test_malformed_calls_never_take_a_cached_kernel(kernel, call):
    """After a good call is cached, a call with an extra positional argument or one given both
    by position and by keyword is refused by name before anything launches."""
    raw, k = kernel
    good = (torch.randn(4), torch.empty(4), 4, 1.0)
    k[(1,)](*good, BLOCK=16)
    with pytest.raises(TypeError, match="positional argument|multiple values for argument 'n'"):
        if call == "too_many":
            k[(1,)](*good, 16, True, "extra")
        else:
            k[(1,)](*good, BLOCK=16, n=8)
    assert _kinds(raw) == ["triton"]


def test_a_malformed_call_names_the_kernel(monkeypatch):
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(launch, "_DRIVER", [(lambda: 0, lambda device: STREAM, True)])
    raw = _Kernel()
    raw.__name__ = "_cast_kernel"
    k = launch.launcher(raw)
    with pytest.raises(TypeError, match=r"_cast_kernel\(\) missing 1 required positional argument: 'scale'"):
        k[(1,)](torch.randn(4), torch.empty(4), 4, BLOCK=16)


def test_parameter_names_that_clash_with_the_generated_code_keep_tritons_path(monkeypatch):
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(launch, "_DRIVER", [(lambda: 0, lambda device: STREAM, True)])
    raw = _Kernel()
    raw.params[2] = SimpleNamespace(name="_te_grid", is_constexpr=False, default=inspect.Parameter.empty)
    k = launch.launcher(raw)
    for _ in range(2):
        k[(1,)](torch.randn(4), torch.empty(4), 4, 1.0, BLOCK=16)
    assert _kinds(raw) == ["triton", "triton"]


def test_host_grid_arithmetic_matches_tritons():
    """te_triton's host cdiv and next_power_of_2 (plain integer arithmetic) give Triton's own
    results, so every grid and block size is what it was with Triton's functions."""
    import triton

    from te_triton import cdiv, next_power_of_2

    for a in [0, 1, 2, 15, 16, 17, 127, 128, 129, 4095, 4096, 4097, 2**31 - 1, 2**33 + 5]:
        for b in (1, 2, 3, 16, 64, 128, 4096):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
        if a >= 1:
            assert next_power_of_2(a) == triton.next_power_of_2(a), a
    assert next_power_of_2(0) == 1  # (Triton's gives 0, which no block size may be)
