"""A plugin that claims a device torch cannot use is not trusted: the registry checks that its
device holds a tensor before selecting it, lists it as broken with the reason and falls back
(auto) or refuses it (named); modules given such a device say so clearly."""
import json
import re
import subprocess
import sys

import pytest
import torch

import te_core as te
from te_core import backend, info
from te_core.backend import BackendError

from registry_fakes import FakeEntryPoint, make_plugin

# Devices this torch build cannot use, each refused in its own way: torch's device module asserts
# (as a GPU module does on a CPU-only build), torch's device module says it is unavailable while the
# plugin's own module says otherwise, an allocation hits an unimplemented dispatch key, and a
# device type torch does not know at all.
LIARS = {
    "torch-module-asserts": ("mtia", dict(te_backend_device_module=None)),
    "torch-says-unavailable": ("mtia", {}),
    "allocation-fails": ("xla", {}),
    "unknown-type": ("nosuchdevice", {}),
}


def _liar(kind):
    device_type, hooks = LIARS[kind]
    return FakeEntryPoint("liar", make_plugin("liar", device_type=device_type, available=(True, "all fine, trust me"),
                                              **hooks))


@pytest.mark.parametrize("kind", list(LIARS))
def test_auto_falls_back_and_lists_the_liar_as_broken(plugins, kind):
    plugins([_liar(kind)])
    with pytest.warns(RuntimeWarning, match="backend 'liar' is broken and is skipped"):
        chosen = backend.get_backend()
    assert chosen.name == "reference"
    assert "liar: broken: claims to be available (all fine, trust me), but" in backend.selection_reason()
    (broken,) = backend.broken_plugins()
    assert broken.name == "liar" and "claims to be available" in broken.error
    assert [b.name for b in backend.list_backends()] == ["reference"]


def test_a_device_type_torch_has_no_module_for_needs_the_device_module_hook(plugins, monkeypatch):
    """'meta' allocates, but torch has no torch.meta module: without te_backend_device_module the
    backend is broken, and the error says which hook to implement."""
    plugins([FakeEntryPoint("nomodule", make_plugin("nomodule", device_type="meta", te_backend_device_module=None))])
    with pytest.warns(RuntimeWarning, match="backend 'nomodule' is broken"):
        assert backend.get_backend().name == "reference"
    (broken,) = backend.broken_plugins()
    assert "Device 'meta' does not have a corresponding module registered as 'torch.meta'" in broken.error
    assert "return your device's module" in broken.error and "from the te_backend_device_module hook" in broken.error
    plugins([FakeEntryPoint("withmodule", make_plugin("withmodule", device_type="meta"))])  # the hook gives one
    monkeypatch.setenv("TE_BACKEND", "withmodule")
    assert backend.get_backend().name == "withmodule" and not backend.broken_plugins()


def test_plain_linear_works_with_a_liar_installed(plugins, gen):
    plugins([_liar("torch-module-asserts")])
    with pytest.warns(RuntimeWarning, match="liar"):
        layer = te.Linear(32, 32)
    assert layer.weight.device.type == "cpu"
    x = torch.randn(5, 32, generator=gen)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias, rtol=1.3e-6, atol=1e-5)


def test_naming_the_liar_is_an_error_with_the_reason(plugins, monkeypatch):
    plugins([_liar("torch-says-unavailable")])
    monkeypatch.setenv("TE_BACKEND", "liar")
    with pytest.raises(BackendError) as err:
        backend.get_backend()
    msg = str(err.value)
    assert msg.startswith("TE_BACKEND='liar': backend 'liar' is installed but broken")
    assert "cannot use mtia:0: torch.mtia.is_available() is False in this torch build" in msg
    with pytest.raises(BackendError, match="installed but broken"):  # and stays broken
        backend.set_backend("liar")


def test_info_lists_the_liar_as_broken_and_does_not_die(plugins):
    plugins([_liar("allocation-fails"), FakeEntryPoint("fake", make_plugin("fake"))])
    report = info.collect()
    assert [b["name"] for b in report["backends"]] == ["reference", "fake"]
    assert report["broken"][0]["name"] == "liar" and "NotImplementedError" in report["broken"][0]["error"]
    assert report["selected"] == "fake"
    assert "liar (te-backend-fake): claims to be available" in info.render(report)


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="needs a torch build without CUDA (its error names that)")
def test_info_survives_a_gpu_liar_in_a_fresh_process(tmp_path):
    """The real registry path: a plugin claiming a GPU on a CPU-only torch, through `te-core info`."""
    (tmp_path / "gpu_liar.py").write_text(
        "from te_core.backend import BackendInfo, hookimpl\n"
        "@hookimpl\ndef te_backend_info(): return BackendInfo(name='gpuliar', device_type='cuda')\n"
        "@hookimpl\ndef te_backend_available(): return True, 'says yes'\n"
        "@hookimpl\ndef te_backend_ops(): return {}\n")
    code = ("import sys; from importlib import metadata; from te_core.backend import registry\n"
            "ep = metadata.EntryPoint('gpuliar', 'gpu_liar', 'te_core.backends')\n"
            "registry._entry_points = lambda: [ep]\n"
            "import te_core as te; from te_core import cli\n"
            "layer = te.Linear(32, 32); assert layer.weight.device.type == 'cpu'\n"
            "sys.exit(cli.main(['info', '--json']))\n")
    out = subprocess.run([sys.executable, "-W", "ignore::RuntimeWarning", "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env={"PATH": "", "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["selected"] == "reference"
    assert "Torch not compiled with CUDA enabled" in report["broken"][0]["error"]


@pytest.mark.parametrize("device", ["mtia", "xla:0"])
def test_module_on_a_device_torch_cannot_use_is_a_clear_error(plugins, device):
    plugins([])
    with pytest.raises(RuntimeError) as err:
        te.Linear(32, 32, device=device)
    msg = str(err.value)
    assert f"device={device!r} is not available in this torch build (torch {torch.__version__})" in msg
    assert "Device types usable here: cpu (backends: reference)" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch build without CUDA")
def test_linear_on_cuda_with_a_cpu_only_torch(plugins):
    plugins([])
    with pytest.raises(RuntimeError, match=re.escape("device='cuda' is not available in this torch build")):
        te.Linear(32, 32, device="cuda")


def test_module_on_a_usable_device_is_unchanged(plugins):
    plugins([])
    assert te.Linear(8, 8, device="cpu").weight.device == torch.device("cpu")
    with pytest.raises(RuntimeError, match="device='gpu0' is not a torch device"):
        te.Linear(8, 8, device="gpu0")
