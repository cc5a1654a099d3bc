"""Discovery, selection and the errors a user sees (te_core.backend.registry)."""
import pathlib
import re

import pytest

import te_core
from te_core import backend
from te_core.backend import BackendError

from registry_fakes import FakeEntryPoint, make_plugin

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]


def test_default_is_reference_when_no_accelerator(plugins):
    plugins([FakeEntryPoint("sleepy", make_plugin("sleepy", available=(False, "no sleepy device")))])
    assert backend.get_backend().name == "reference"
    assert "no accelerator backend available" in backend.selection_reason()
    assert "sleepy: no sleepy device" in backend.selection_reason()


def test_auto_picks_available_accelerator(plugins):
    plugins([FakeEntryPoint("fake", make_plugin("fake"))])
    chosen = backend.get_backend()
    assert chosen.name == "fake" and chosen.distribution == "te-backend-fake"
    assert str(chosen.device) == "meta:0"
    assert chosen.capabilities.arch == "fake_1"


def test_cpu_plugins_are_not_picked_by_auto(plugins):
    plugins([FakeEntryPoint("cpuish", make_plugin("cpuish", device_type="cpu"))])
    assert backend.get_backend().name == "reference"
    assert backend.set_backend("cpuish").name == "cpuish"


def test_te_backend_env_selects(plugins, monkeypatch):
    plugins([FakeEntryPoint("fake", make_plugin("fake"))])
    monkeypatch.setenv("TE_BACKEND", "reference")
    assert backend.get_backend().name == "reference"
    assert backend.selection_reason() == "TE_BACKEND=reference"


def test_unknown_backend_lists_installed_without_a_hint_for_them(plugins, monkeypatch):
    plugins([FakeEntryPoint("fake", make_plugin("fake")), FakeEntryPoint("cuda", make_plugin("cuda"))])
    monkeypatch.setenv("TE_BACKEND", "nope")
    with pytest.raises(BackendError) as err:
        backend.get_backend()
    msg = str(err.value)
    assert msg.startswith("TE_BACKEND='nope': unknown backend 'nope'")
    assert "Installed backends: cuda, fake, reference, or 'auto'" in msg
    assert "backends/cuda" not in msg  # installed: no install hint for it
    assert "te-backend-cuda" not in msg  # no package index serves the vendor wheels


def test_typo_in_backend_name_suggests_the_installed_one(plugins):
    plugins([FakeEntryPoint("fake", make_plugin("fake"))])
    with pytest.raises(BackendError, match=re.escape("unknown backend 'fak' (did you mean 'fake'?)")):
        backend.set_backend("fak")


def test_known_backend_not_installed_gives_the_repository_install_command(plugins, monkeypatch):
    monkeypatch.chdir(REPOSITORY)
    plugins([])
    monkeypatch.setenv("TE_BACKEND", "cuda")
    with pytest.raises(BackendError) as err:
        backend.get_backend()
    msg = str(err.value)
    assert "backend 'cuda' is not installed" in msg
    assert "pip install ./backends/triton ./backends/cuda" in msg
    assert "Installed backends: reference" in msg


def test_installed_but_unavailable_gives_reason(plugins):
    plugins([FakeEntryPoint("sleepy", make_plugin("sleepy", available=(False, "driver too old (needs 550)")))])
    with pytest.raises(BackendError, match=re.escape("installed but not available on this machine: driver too old (needs 550)")):
        backend.set_backend("sleepy")


def test_two_plugins_one_name_names_both_distributions(plugins):
    plugins([
        FakeEntryPoint("a", make_plugin("twin"), dist="te-backend-twin-a"),
        FakeEntryPoint("b", make_plugin("twin"), dist="te-backend-twin-b"),
    ])
    with pytest.raises(BackendError) as err:
        backend.set_backend("twin")
    assert "te-backend-twin-a" in str(err.value) and "te-backend-twin-b" in str(err.value)
    assert backend.get_backend().name == "reference"  # auto skips the conflict
    assert {b.distribution for b in backend.broken_plugins()} == {"te-backend-twin-a", "te-backend-twin-b"}


def test_reference_name_is_reserved(plugins):
    plugins([FakeEntryPoint("imposter", make_plugin("reference", device_type="cpu"), dist="te-backend-imposter")])
    assert backend.get_backend("reference").distribution == "te-core (built in)"
    assert any("reserved" in b.error for b in backend.broken_plugins())


def test_api_major_mismatch_is_rejected_naming_both(plugins):
    plugins([FakeEntryPoint("old", make_plugin("old", api_version="0.3"))])
    (broken,) = backend.broken_plugins()
    assert "API 0.3" in broken.error and f"API {backend.API_VERSION}" in broken.error
    with pytest.raises(BackendError, match="installed but broken"):
        backend.set_backend("old")


def test_import_failure_is_recorded_and_harmless(plugins):
    plugins([FakeEntryPoint("bad", error=ImportError("libfoo.so: cannot open shared object file"))])
    (broken,) = backend.broken_plugins()
    assert broken.name == "bad" and "libfoo.so" in broken.error
    assert backend.get_backend().name == "reference"


def test_hook_that_raises_marks_plugin_broken(plugins):
    def te_backend_available():
        raise RuntimeError("probe crashed")

    te_backend_available = backend.hookimpl(te_backend_available)
    plugins([FakeEntryPoint("crashy", make_plugin("crashy", te_backend_available=te_backend_available))])
    (broken,) = backend.broken_plugins()
    assert "te_backend_available raised RuntimeError: probe crashed" in broken.error
    assert [b.name for b in backend.list_backends()] == ["reference"]


def test_unknown_hook_and_missing_required_hook(plugins):
    @backend.hookimpl
    def te_backend_opz():
        return {}

    plugins([
        FakeEntryPoint("typo", make_plugin("typo", te_backend_opz=te_backend_opz)),
        FakeEntryPoint("partial", make_plugin("partial", te_backend_ops=None)),
    ])
    errors = {b.name: b.error for b in backend.broken_plugins()}
    assert "unknown hook 'te_backend_opz'" in errors["typo"] or "te_backend_opz" in errors["typo"]
    assert "required hook(s) te_backend_ops" in errors["partial"]


def test_ops_must_be_contract_ops(plugins):
    plugins([FakeEntryPoint("weird", make_plugin("weird", ops={"flash_everything": lambda: None}))])
    with pytest.raises(BackendError, match="'flash_everything', which is not a contract op"):
        backend.set_backend("weird")


def test_allowlist_limits_loaded_plugins(plugins, monkeypatch):
    monkeypatch.setenv("TE_BACKEND_PLUGINS", "keep")
    entry_points = [FakeEntryPoint("keep", make_plugin("keep")), FakeEntryPoint("drop", make_plugin("drop"))]
    from te_core.backend import registry

    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: entry_points)
    registry.REGISTRY.reset()
    assert sorted(b.name for b in backend.list_backends()) == ["keep", "reference"]


def test_is_fp8_available_follows_capabilities(plugins):
    from te_core.backend.types import Capabilities

    plugins([FakeEntryPoint("nofp8", make_plugin("nofp8", caps=Capabilities(arch="old_7", device_name="Old")))])
    ok, reason = te_core.is_fp8_available(return_reason=True)
    assert not ok and "E4M3 not supported on Old old_7" in reason
    assert te_core.is_fp8_available() is False
    backend.set_backend("reference")
    assert te_core.is_fp8_available(return_reason=True) == (True, "")
    assert te_core.is_fp8_available() is True


def test_reference_backend_names_gloo_as_its_cpu_collective_library():
    """Code that picks torch.distributed's library from the backend (as the MUSA docs show) runs
    on the reference backend on a CPU: a one-rank gloo group all-reduces."""
    import socket

    import torch
    import torch.distributed as dist

    from te_core.reference.plugin import te_backend_capabilities as te_capabilities

    library = te_capabilities(torch.device("cpu")).distributed_backend
    assert library == "gloo"
    assert te_capabilities(torch.device("meta")).distributed_backend == ""
    if dist.is_initialized():
        return
    with socket.socket() as s:  # a free port, so no other group's rendezvous is in the way
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(library, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        x = torch.arange(4.0)
        dist.all_reduce(x)
        assert torch.equal(x, torch.arange(4.0))
    finally:
        dist.destroy_process_group()
