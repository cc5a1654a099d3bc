"""`pytest --pyargs te_core.testing --te-backend NAME` run as a vendor would, in a subprocess:
a broken backend (installed here as a throw-away distribution with an entry point) fails,
the template passes with its declined case and undeclared ops skipped with reasons, and an
unknown name errors with the registry's explanation. A vendor's own tests on the kit's
fixtures test the backend --te-backend or TE_BACKEND names, never the reference by default."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

BROKEN_PLUGIN = textwrap.dedent(
    """
    import torch
    from te_core.backend import BackendInfo, OpImpl, hookimpl
    from te_core.reference import plugin as reference

    @hookimpl
    def te_backend_info():
        return BackendInfo(name="broken", device_type="cpu", description="rounds FP8 casts toward zero")

    @hookimpl
    def te_backend_available():
        return True, "test double"

    @hookimpl
    def te_backend_capabilities(device):
        return reference.te_backend_capabilities(device)

    def quantize_fp8(x, scale, fp8_dtype):
        y = (x.float() * scale).clamp(-448.0, 448.0)
        y = (y.view(torch.int32) & ~((1 << 20) - 1)).view(torch.float32)  # drops mantissa bits
        return y.to(fp8_dtype), x.float().abs().amax()

    def only_e4m3(x, scale, fp8_dtype):
        return fp8_dtype == torch.float8_e4m3fn, "this test double only casts to E4M3"

    @hookimpl
    def te_backend_ops():
        ref = reference.implementations()
        return {"quantize_fp8": OpImpl(quantize_fp8, supports=only_e4m3), "gemm": ref["gemm"]}
    """
)


def _run_kit(cwd, backend, *args, pythonpath=None):
    env = dict(os.environ)
    env.pop("TE_BACKEND", None)
    env.pop("TE_BACKEND_PLUGINS", None)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "te_core.testing",
           "--te-backend", backend, "-q", "-rfs", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _install_broken_backend(path):
    (path / "broken_te_backend.py").write_text(BROKEN_PLUGIN)
    dist = path / "te_backend_broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: te-backend-broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[te_core.backends]\nbroken = broken_te_backend\n")


def test_broken_backend_fails_the_kit(tmp_path):
    _install_broken_backend(tmp_path)
    result = _run_kit(tmp_path, "broken", "-k", "quantize_fp8 or gemm or api_version", pythonpath=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert any("test_op_matches_reference[quantize_fp8[fp32-e4m3-16x32]]" in line for line in failed), out
    assert all("[quantize_fp8[" in line for line in failed), out  # its correct gemm passes
    assert "FP8 values differ from the reference" in out, out
    assert "declined by supports(): this test double only casts to E4M3" in out, out
    assert "fallback to reference: not declared by backend 'broken' (gemm_fp8)" in out, out


def test_template_passes_with_declines_and_fallbacks_reported(tmp_path):
    result = _run_kit(tmp_path, "template")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "declined by supports(): gemm_fp8 needs M, N, K multiples of 16, got M=33, N=40, K=24" in out, out
    assert "fallback to reference: not declared by backend 'template' (rmsnorm_fwd)" in out, out
    assert " passed" in out and " failed" not in out, out


def test_unknown_backend_errors_with_the_registry_reason(tmp_path):
    result = _run_kit(tmp_path, "no-such-backend", "-k", "api_version")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "--te-backend no-such-backend: unknown backend 'no-such-backend'" in out, out


OWN_TEST = textwrap.dedent(
    """
    import torch
    from te_core.testing.inputs import Case, pow2, randn
    from te_core.testing.runner import run_case

    def test_extra_cast(te_backend, te_device, reference_impls):
        from te_core import backend

        print(f"backend under test: {te_backend.name}; selected: {backend.get_backend().name}")
        case = Case("quantize_fp8", "extra", lambda g: ((randn(g, 64, 64, std=50.0), pow2(0), torch.float8_e4m3fn), {}))
        run_case(case, te_backend.ops["quantize_fp8"].fn, reference_impls["quantize_fp8"], te_device)
    """
)


def _run_own_tests(path, *args, te_backend=None):
    """The vendor's own test file (docs/backends.md, section 7) run with pytest, TE_BACKEND set or not."""
    (path / "test_own.py").write_text(OWN_TEST)
    env = {k: v for k, v in os.environ.items() if k not in ("TE_BACKEND", "TE_BACKEND_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")])
    if te_backend is not None:
        env["TE_BACKEND"] = te_backend
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-s", "test_own.py", *args]
    result = subprocess.run(cmd, cwd=path, env=env, capture_output=True, text=True, timeout=300)
    return result.returncode, result.stdout + result.stderr


def test_own_tests_on_the_fixtures_test_the_named_backend(tmp_path):
    """The audit's finding: the fixtures defaulted to the reference and ignored TE_BACKEND, so a
    vendor's extra tests compared the reference with itself and passed."""
    _install_broken_backend(tmp_path)
    for how in (dict(te_backend="broken"), dict(args=("--te-backend", "broken"))):
        code, out = _run_own_tests(tmp_path, *how.get("args", ()), te_backend=how.get("te_backend"))
        assert code == 1 and "backend under test: broken;" in out and "FP8 values differ" in out, (how, out)
    code, out = _run_own_tests(tmp_path, "--te-backend", "reference", te_backend="broken")  # the option wins
    assert code == 0 and "backend under test: reference" in out, out
    code, out = _run_own_tests(tmp_path, te_backend="auto")  # the backend auto selects on this machine
    under_test = re.search(r"backend under test: (\S+); selected: (\S+)", out)
    assert code == 0 and under_test and under_test[1] == under_test[2] != "broken", out
    code, out = _run_own_tests(tmp_path)
    assert code == 0 and "backend under test: reference" in out, out
